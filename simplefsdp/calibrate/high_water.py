"""The most memory a call allocates above what was held before it: the one measurement behind
`simplefsdp calibrate`'s staging factors and the benchmarks' peak memory per rank.

On CUDA: `torch.cuda.max_memory_allocated` above `memory_allocated` (the caching allocator's tensor
bytes). On the CPU: the kernel's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the call) above the resident size before it -- everything the
process touches, so a caller that wants freed blocks to leave it must arrange that (glibc
returns blocks above its mmap threshold at once; see `bench/_harness.py`). Linux only on the CPU.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["high_water_bytes"]

_RSS = re.compile(r"VmRSS:\s+(\d+) kB")
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")
_STATUS = Path("/proc/self/status")


def high_water_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes `fn()` allocates above what was held before it, at its peak (module docstring)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = int(_RSS.search(_STATUS.read_text()).group(1))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the resident size now
    fn()
    return (int(_HWM.search(_STATUS.read_text()).group(1)) - before) * 1024
