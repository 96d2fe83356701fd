"""The most memory a call allocates above what was held before it, two ways: the measurements
behind `simplefsdp calibrate`'s staging factors and the benchmarks' peak memory per rank.

`tensor_high_water_bytes`: torch's allocator, tensor bytes. On CUDA `torch.cuda.max_memory_allocated`
above `memory_allocated`; on the CPU the allocator's running total of tensor bytes, kept over every
thread during the call (`count_cpu_allocations_on_every_thread`), read at each allocation and free
`torch.profiler` records on the calling thread: its maximum above the start. That counts inductor's
buffers, the CPU autograd engine's (it runs backward on the calling thread) and gloo's staging
tensors (allocated when the collective is issued, freed on gloo's worker thread for a reduction).
A tensor another thread allocates and frees between two events of the calling thread is not seen.
A tensor allocated before the accounting was on and freed in the call is not subtracted: a series
of measurements (a step settled, then measured) runs inside one `count_cpu_allocations_on_every_thread()`
block, so what lives from one call into the next is counted.

`high_water_bytes`: on CUDA the same; on the CPU the kernel's resident high-water mark (VmHWM, reset
through /proc/self/clear_refs just before the call) above the resident size before it --
everything the process touches, gloo's own scratch included, and also freed memory glibc keeps.

[Note: resident is not allocated]
glibc serves a large request from the free top of an existing heap when it fits there, whatever
the mmap threshold says, and a block freed inside a heap stays resident until `malloc_trim`. Over
one training step of a compiled FSDP model on 2 gloo ranks, 35-52 MiB stayed resident after every
tensor of the step was freed (all of it returned by one `malloc_trim(0)`), so the resident peak
moved by 15-30% with the allocation history, not with what the step holds. Peaks that compare
schedules use the tensor measure; the resident one is for what lives outside torch's allocator
(gloo's scratch, as calibrate's staging factors do). Linux only on the CPU.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path

import torch

from simplefsdp._compat import allocator_events, count_cpu_allocations_on_every_thread

__all__ = ["count_cpu_allocations_on_every_thread", "high_water_bytes", "tensor_high_water_bytes"]

_RSS = re.compile(r"VmRSS:\s+(\d+) kB")
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")
_STATUS = Path("/proc/self/status")


def _cuda_high_water_bytes(fn: Callable[[], object], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def tensor_high_water_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Tensor bytes `fn()` allocates above what was held before it, at its peak (module docstring).

    On the CPU a tensor allocated while the accounting was off and freed during the call is not
    subtracted (the allocator did not record its size), so the peak can only come out high, never
    low, by such tensors (module docstring)."""
    gc.collect()
    if device.type == "cuda":
        return _cuda_high_water_bytes(fn, device)
    with (
        count_cpu_allocations_on_every_thread(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    events = allocator_events(prof)
    if not events:
        return 0
    _, nbytes, total = events[0]
    start = total - nbytes
    # before a free the total was higher by what it freed: counts what other threads hold then
    return max(max(total, total - nbytes) for _, nbytes, total in events) - start


def high_water_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes `fn()` allocates above what was held before it, at its peak: resident on the CPU
    (module docstring)."""
    gc.collect()
    if device.type == "cuda":
        return _cuda_high_water_bytes(fn, device)
    before = int(_RSS.search(_STATUS.read_text()).group(1))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the resident size now
    fn()
    return (int(_HWM.search(_STATUS.read_text()).group(1)) - before) * 1024
