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
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simplefsdp.passes.cost import DeviceProfile

__all__ = ["main"]


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
    # torch loads here, once the flags have parsed: the help and a bad flag answer at once
    from simplefsdp.calibrate.run import calibrate
    from simplefsdp.ranks import RankFailedError, gets_the_result, setup_rank_logging
    from simplefsdp.writable import check_file

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
