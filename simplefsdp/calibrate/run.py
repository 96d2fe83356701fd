"""`calibrate()`: measure on the ranks, fit a device profile, write its file (`simplefsdp calibrate`
is `cli.py`, which imports this once its flags have parsed)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import socket
from pathlib import Path

import torch

from simplefsdp.calibrate.fit import profile_from
from simplefsdp.calibrate.timings import Measurements, measure
from simplefsdp.passes.cost import DeviceProfile, save_profile
from simplefsdp.ranks import gets_the_result, run_on_ranks
from simplefsdp.writable import check_file

__all__ = ["calibrate"]

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
