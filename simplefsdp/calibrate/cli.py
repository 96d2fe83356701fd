"""`simplefsdp calibrate`: measure this machine and write a device profile file.

    simplefsdp calibrate                         # 2 CPU ranks (gloo) or one per GPU (NCCL) -> profile.json
    simplefsdp calibrate --out cpu.json --quick  # seconds: fewer sizes and repeats, a rough profile
    torchrun --nproc-per-node 8 -m simplefsdp.calibrate --out h100x8.json

Use the file wherever a device profile name is taken: `BucketConfig(device="cpu.json")`,
`simplefsdp inspect MODEL --device cpu.json`, `simplefsdp train --profile cpu.json`. Every rank of
a job must use the same file (the auto plan then decides identically on every rank). The file also
keeps the raw measurements it was fitted from, and where and when they were taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from simplefsdp.calibrate.fit import profile_from
from simplefsdp.calibrate.timings import Measurements, measure
from simplefsdp.passes.cost import DeviceProfile, save_profile
from simplefsdp.ranks import RankFailedError, gets_the_result, run_on_ranks, setup_rank_logging
from simplefsdp.writable import check_file

__all__ = ["calibrate", "main"]

_TIMEOUT = datetime.timedelta(minutes=5)  # no collective here waits longer unless a rank is stuck


def _measure_rank(quick: bool, device: torch.device) -> Measurements:
    return measure(device=device, quick=quick)


def calibrate(
    *,
    out: str | Path,
    nproc: int | None = None,
    device_type: str | None = None,
    quick: bool = False,
    name: str = "",
    capacity_bytes: float | None = None,
) -> DeviceProfile | None:
    """Measure, fit, and write the profile to `out` (rank 0); returns it (None on the other ranks when
    this process is one of them). `capacity_bytes`: the memory one rank may use, instead of what the
    host reports.

    The ranks (`simplefsdp.ranks.run_on_ranks`): those of the default process group when this process
    is in one (collective: every rank calls it; the group stays as it is), else torchrun's (a group
    joined for the call and left after), else `nproc` spawned ones. This process's logging and
    warning filters are left as they are; `simplefsdp calibrate` (`main`) quiets the other ranks.
    A `ValueError` naming `out` comes before any measurement when the file cannot be written there."""
    if gets_the_result():
        check_file(out, name="out")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    measured = run_on_ranks(
        functools.partial(_measure_rank, quick), nproc=nproc, device_type=device_type, timeout=_TIMEOUT
    )
    if measured is None:  # a rank other than 0 of this process's group or torchrun job
        return None
    name = name or f"{device_type}-{measured.world_size}x-{socket.gethostname()}"
    profile = profile_from(measured, name=name)
    if capacity_bytes is not None:
        profile = dataclasses.replace(profile, capacity_bytes=float(capacity_bytes))
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "quick": quick,
    }
    save_profile(profile, out, extra={"measured": dataclasses.asdict(measured), "meta": meta})
    return profile


def _host_tier_text(profile: DeviceProfile) -> str:
    if profile.host_link_bytes_per_s is None or profile.host_memory_bytes_per_s is None:
        return "absent: the host is the device (offload moves nothing)"
    capacity = (
        "" if profile.host_capacity_bytes is None else f", {profile.host_capacity_bytes / 2**30:,.1f} GiB per rank"
    )
    return (
        f"copies {profile.host_link_bytes_per_s / 1e9:,.1f} GB/s, optimizer step "
        f"{profile.host_memory_bytes_per_s / 1e9:,.1f} GB/s{capacity}"
    )


def _describe(profile: DeviceProfile) -> str:
    width = 22  # the longest label: "reduce_scatter_copy_in"

    def line(label: str, text: str) -> str:
        return f"  {label:<{width}} {text}"

    capacity = "unknown" if profile.capacity_bytes is None else f"{profile.capacity_bytes / 2**30:,.1f} GiB per rank"
    lines = [
        f"profile {profile.name!r}",
        line("matmul", f"{profile.flops_per_s / 1e9:,.1f} GFLOP/s"),
        line("memory", f"{profile.memory_bytes_per_s / 1e9:,.2f} GB/s"),
        line("compiled compute", f"{profile.compute_scale:.2f} x the roofline of those two rates"),
        line("overlap", f"{profile.overlap:.2f} of communication time runs beside compute"),
        line("capacity", capacity),
        line("host tier", _host_tier_text(profile)),
    ]
    for kind, latency, bandwidth in profile.collectives:
        staged = profile.staging_factor(kind)
        text = f"{latency * 1e6:,.0f} us + bytes / {bandwidth / 1e9:,.2f} GB/s"
        lines.append(line(kind, text + (f", stages {staged:.2f} x its buffer" if staged else "")))
    lines.append(
        line(
            "after idle",
            f"+{profile.wake_s * 1e6:,.0f} us wake-up (tau {profile.wake_tau_s * 1e3:.2f} ms)"
            f" + {profile.drift:.2f} s per s of compute"
            + (f" (up to {profile.drift_span_s * 1e3:.1f} ms of it)" if profile.drift_span_s else ""),
        )
    )
    for kind, seconds, per_byte in profile.launch:
        rate = f" + bytes / {1 / per_byte / 1e9:,.2f} GB/s" if per_byte else ""
        lines.append(line(f"{kind} launch", f"{seconds * 1e6:,.0f} us{rate} of the caller's time"))
    for op, seconds, per_tensor in profile.copy_ops:
        lines.append(line(op, f"{seconds * 1e6:,.0f} us + {per_tensor * 1e6:,.1f} us per member tensor, a call"))
    for name, per_tensor, per_element in profile.optimizers:
        lines.append(line(name, f"{per_tensor * 1e6:,.1f} us per parameter + {per_element * 1e9:.2f} ns per element"))
    step = f"+{profile.step_collective_s * 1e6:,.0f} us per collective"
    step += f", +{profile.step_exposed_wait_s * 1e6:,.0f} us per wait with no compute since its launch"
    step += f", +{profile.step_hidden_s * 1e6:,.0f} us per collective run behind compute"
    lines.append(line("in a compiled step", step))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simplefsdp calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="profile.json", help="profile file to write (default: profile.json)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: 2 on the CPU, every GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and repeats, a tiny probe model run without inductor: seconds, not minutes; "
        "checks the set-up, not a profile to plan with",
    )
    parser.add_argument("--name", default="", help="the profile's name (default: device, ranks and host)")
    parser.add_argument(
        "--memory-gib", type=float, default=None, help="memory per rank (default: what the device / host reports)"
    )
    args = parser.parse_args(argv)
    if args.nproc is not None and args.nproc < 2:
        parser.error("--nproc must be at least 2: collectives need two ranks to measure")
    if args.memory_gib is not None and not args.memory_gib > 0:
        parser.error(f"--memory-gib must be > 0, got {args.memory_gib}")
    capacity = None if args.memory_gib is None else args.memory_gib * 2**30
    setup_rank_logging()  # a torchrun rank: errors only on ranks > 0, as spawned ranks
    try:
        if gets_the_result():
            check_file(args.out, name="--out")
        profile = calibrate(
            out=args.out,
            nproc=args.nproc,
            device_type=args.device,
            quick=args.quick,
            name=args.name,
            capacity_bytes=capacity,
        )
    except (ValueError, RankFailedError) as error:
        print(f"simplefsdp calibrate: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    if profile is not None:
        print(_describe(profile))
        print(f"wrote {args.out}")
    return 0
