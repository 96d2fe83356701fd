"""What glibc does with memory a CPU step frees: keep it for the next step, or give it back.

[Note: freed memory kept on the CPU]
A training step allocates and frees the same buffers every step: gathered buckets, the
reduce-scatter's input, gloo's copies of both, activations. glibc serves a block of 128 KiB or more
as a mapping of its own and unmaps it when freed (the threshold rises to the largest block freed,
up to 32 MiB), and it hands the free top of its heap back to the system once that top exceeds the
trim threshold (twice the mmap threshold). Either way the next step's buffer can be fresh memory,
and every 4 KiB page of it faults in on its first write -- in particular in the arenas of threads
other than the main one (gloo's workers, the autograd engine's): 36 MiB of buffers allocated,
written and freed on one worker thread faulted 3,800-4,300 pages into every later round under
glibc's default, none when kept (`tests/simplefsdp/test_cpu_memory.py`). On 2 gloo ranks, keeping
freed memory cuts a compiled step's minor faults about tenfold and its step time by a tenth or more
(the faults land in the copy-in op, the clone gloo makes of a reduce-scatter's input and gloo's own
copies, on the step's critical path), and leaves FSDP2 eager's step time where it was
(bench/results/measurements.md, "freed memory kept").

`keep_freed_memory` sets the trim threshold to 1 GiB and the mmap threshold to 32 MiB (the largest
the dynamic threshold reaches): blocks under 32 MiB come from the heap, and up to 1 GiB of freed heap
stays resident for reuse -- what PyTorch's caching allocator does on a GPU. Blocks of 32 MiB and
more still come and go as mappings of their own (the calibration's staging measurement relies on it:
`calibrate/high_water.py`). The cost: a rank's resident memory stays near its high-water mark.
Spawned CPU ranks (`simplefsdp.ranks.run_on_ranks`: `simplefsdp train`, `simplefsdp calibrate`) call
it; under torchrun the process is the user's, who may call it. `return_freed_memory` and
`trim_freed_memory` undo it for measurements of resident memory (`bench/`).

Linux with glibc only; elsewhere the functions do nothing and return False.
"""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["keep_freed_memory", "return_freed_memory", "trim_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_TRIM_BYTES = 2**30
MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20  # glibc's largest dynamic mmap threshold on 64-bit hosts
GLIBC_TRIM_BYTES = 128 * 2**10  # glibc's default trim threshold


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _mallopt(**settings: int) -> bool:
    libc = _libc()
    if libc is None:
        logger.debug("not glibc: freed memory is handled by the system's allocator as it is")
        return False
    codes = {"trim": _M_TRIM_THRESHOLD, "mmap": _M_MMAP_THRESHOLD}
    return all(libc.mallopt(codes[name], value) == 1 for name, value in settings.items())


def keep_freed_memory() -> bool:
    """Keep freed memory for reuse ([Note: freed memory kept on the CPU]); True if glibc took it."""
    return _mallopt(mmap=MMAP_THRESHOLD_MAX_BYTES, trim=KEEP_TRIM_BYTES)


def return_freed_memory(*, mmap_threshold_bytes: int = 64 * 2**10) -> bool:
    """Map blocks of `mmap_threshold_bytes` and more on their own (unmapped when freed) and give back
    a free heap top above glibc's default trim threshold, so resident memory follows what is
    allocated; True if glibc took it."""
    return _mallopt(mmap=mmap_threshold_bytes, trim=GLIBC_TRIM_BYTES)


def trim_freed_memory() -> bool:
    """Give back every free page glibc holds now (`malloc_trim(0)`); True if glibc is there."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
