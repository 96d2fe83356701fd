"""`simplefsdp calibrate`: measure the machine and the process group, fit a cost-model profile.

    profile = calibrate(out="cpu.json", quick=True)    # spawns 2 CPU ranks (or one per GPU)
    BucketConfig(plan="auto", device="cpu.json")        # plan with it

`timings.py` times matmuls, copies, collectives and their overlap on every rank; `fit.py` turns the
times into a `DeviceProfile`; `cli.py` is the command.
"""

from simplefsdp.calibrate.cli import calibrate
from simplefsdp.calibrate.fit import profile_from
from simplefsdp.calibrate.timings import Measurements, measure

__all__ = ["Measurements", "calibrate", "measure", "profile_from"]
