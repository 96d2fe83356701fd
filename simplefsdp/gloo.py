"""A gloo process group that runs its collectives on one worker thread, and a check for the default one.

    dist.init_process_group(simplefsdp.gloo.backend(), ...)   # CPU ranks: gloo, one worker thread

`simplefsdp.ranks` (so `simplefsdp train` and `simplefsdp calibrate`) and the benchmarks start their
CPU ranks this way; `wrap()` warns once when it shards over a gloo group with more worker threads.

[Note: torch's two gloo workers race]
torch's gloo process group (checked on 2.13) runs collectives on a pool of worker threads, two by
default and always two through `init_process_group("gloo")`. Each worker, after finishing a
collective and without holding a lock, stores the collective's name into one `std::string` of the
group's status record, shared by the workers. When two collectives finish at the same moment, the two
threads assign that string at once: one frees its heap buffer while the other copies into it, and
glibc aborts the process later ("malloc(): unaligned tcache chunk detected", SIGABRT; once SIGSEGV).
AddressSanitizer over a failing run (2 ranks, libasan preloaded) reported exactly that: a 9-byte
write (a name such as "ALLGATHER") by one worker into a 20-byte string buffer the other had just
freed, both inside `ProcessGroupGloo::runLoop`. Whatever else the stray write hits first (a freed
block can already hold something new) is not known; the abort is what was seen.

Two collectives finish together only when both are in flight: a prefetched all-gather beside a
pending reduce-scatter, or several small buckets: a plan with small buckets killed a rank in most
runs of 600 steps, the per-block plan in none seen -- rarer, not impossible, and FSDP2's eager
prefetch is exposed the same way (bench/results/measurements.md, "gloo's two workers race"). With one worker thread
the race cannot happen: the collectives of a group run one after another, in the order every rank
issued them (so no new deadlock), still asynchronously to the Python thread that launched them.
With one worker, the same small-bucket plan ran every run clean. What it costs is the overlap of
collectives with each other: a plan with many collectives in flight runs markedly slower, the
per-block plan, with one or two in flight, as fast (same record).

The fix belongs in torch (a lock, or an atomic status); until then a CPU job gets this backend from
simplefsdp's launchers, and `wrap()` warns when it meets a gloo group with more than one worker.

[Note: how the backend is made]
`init_process_group("gloo")` gives no way to set the worker count (its gloo options are ignored),
so this module registers a backend named `BACKEND` with torch's public plugin registry
(`Backend.register_backend`, CPU only) whose factory builds the same `ProcessGroupGloo` with its
options' thread count set to one (`_compat.gloo_with_one_worker`). The group is a real gloo group --
DeviceMesh, DTensor, the functional collectives, `torch.distributed.checkpoint` and FSDP2 run on it
unchanged -- but `dist.get_backend()` names it `BACKEND`, not "gloo".
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from simplefsdp._compat import gloo_with_one_worker, gloo_worker_threads

__all__ = ["BACKEND", "backend", "is_gloo", "warn_if_racy"]

logger = logging.getLogger(__name__)

BACKEND = "simplefsdp_gloo"
_warned: set[int] = set()


def backend() -> str:
    """The name to pass to `init_process_group` for a one-worker gloo group (registered on first call)."""
    if not hasattr(dist.Backend, BACKEND.upper()):  # register_backend sets the attribute
        dist.Backend.register_backend(BACKEND, gloo_with_one_worker, devices=["cpu"])
    return BACKEND


def is_gloo(name: str) -> bool:
    """`name` (what `dist.get_backend()` returns) is gloo: torch's own or this module's."""
    return name in ("gloo", BACKEND)


def warn_if_racy(group: dist.ProcessGroup) -> None:
    """Warn once per group if its gloo backend runs collectives on more than one worker thread
    ([Note: torch's two gloo workers race])."""
    threads = gloo_worker_threads(group)
    if threads is None or threads <= 1 or id(group) in _warned:
        return
    _warned.add(id(group))
    logger.warning(
        "process group %r runs gloo collectives on %d worker threads: torch's gloo backend can corrupt the "
        "heap when two collectives finish at once (a race on its status record; see simplefsdp/gloo.py). "
        "Create CPU groups with init_process_group(simplefsdp.gloo.backend(), ...) for one worker thread.",
        group.group_name,
        threads,
    )
