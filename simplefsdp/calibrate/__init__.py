"""`simplefsdp calibrate`: measure the machine and the process group, fit a cost-model profile.

    profile = calibrate(out="cpu.json", quick=True)    # spawns 2 CPU ranks (or one per GPU)
    BucketConfig(plan="auto", device="cpu.json")        # plan with it

`timings.py` times matmuls, copies, collectives and their overlap on every rank; `fit.py` turns the
times into a `DeviceProfile`; `run.py` is `calibrate()`, `cli.py` the command. The names load on
first use ([Note: lazy package exports] in `simplefsdp/_lazy.py`).
"""

from simplefsdp._lazy import lazy_exports

__all__ = ["Measurements", "calibrate", "measure", "profile_from"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "simplefsdp.calibrate.run": ("calibrate",),
        "simplefsdp.calibrate.fit": ("profile_from",),
        "simplefsdp.calibrate.timings": ("Measurements", "measure"),
    },
)
