"""Collective helpers for checkpointing: rank / world without a process group, timed barriers, agreement.

Every function here is a collective when a process group is initialised (all ranks must call it in
the same order) and a local no-op without one, so the checkpoint functions also run in one plain
process.

[Note: a rank that disappears]
Under torchrun a dead rank takes the job down and the agent restarts it. Outside torchrun nothing
watches the ranks, so a survivor waits in the next collective. Two things bound that wait:
- `init_process_group(timeout=...)`: every collective of the group (the training step's included)
  fails after that long, with the backend's own message (gloo: "Timed out waiting ... for recv");
- at the start and end of every checkpoint save / load, `wait_for_all_ranks(timeout=)`. On gloo it
  is torch's `monitored_barrier`, whose error names the ranks that did not arrive; we re-raise it
  as a `RankTimeoutError` saying what was being done. torch's monitored barrier accepts only the
  backend named "gloo", so on simplefsdp's one-worker gloo (`simplefsdp/gloo.py`) it is a barrier
  waited with the timeout (the error then names no rank). Other backends have no monitored
  barrier: there the plain barrier is bounded by the group's own timeout.

[Note: deciding together]
One rank's view of a shared filesystem can differ from the others': a permission or I/O error on
one host, an NFS directory cache that does not show another node's file yet. A decision each rank
takes from its own reads -- which checkpoint to load, which files a manifest covers -- then
differs between ranks, and ranks that disagree call different collectives and hang. So such a
decision is taken on merged inputs: each rank reports what it saw (`all_gather_objects`,
`agree_on_problems`) and every rank applies the same rule to the same report. A read that can fail
on one rank alone reports the failure as a problem instead of raising past the next collective.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from simplefsdp import gloo
from simplefsdp.checkpoint.errors import RankTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "agree_on_problems",
    "all_gather_objects",
    "broadcast_object",
    "is_distributed",
    "rank",
    "wait_for_all_ranks",
    "world_size",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)  # how long a checkpoint function waits for the slowest rank


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def wait_for_all_ranks(*, what: str, timeout: timedelta) -> None:
    """Return once every rank has called this; raise `RankTimeoutError` naming `what` after `timeout`."""
    if not is_distributed() or world_size() == 1:
        return
    try:
        backend = dist.get_backend()
        if backend == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        elif gloo.is_gloo(backend):  # torch's monitored_barrier accepts only the backend named "gloo"
            dist.barrier(async_op=True).wait(timeout=timeout)
        else:
            dist.barrier()
    except RuntimeError as err:
        raise RankTimeoutError(
            f"rank {rank()}: not every rank reached {what} within {timeout.total_seconds():g}s "
            f"(a rank died, hangs, or skipped the call): {err}"
        ) from err


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, indexed by rank (JSON-like values only: the transport pickles them)."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_on_problems(problems: list[str]) -> list[str]:
    """Every rank's `problems` merged: the same sorted list on every rank, [] iff no rank had one.

    A problem that not every rank reported names the ranks that did ("... (seen by rank 1)"), so
    a fault one host alone meets (a permission, a stale cache, a failing disk) says where it is.
    """
    seen_by: dict[str, list[int]] = {}
    for reporter, part in enumerate(all_gather_objects(list(problems))):
        for problem in part:
            seen_by.setdefault(problem, []).append(reporter)
    everyone = list(range(world_size()))
    return sorted(
        problem if ranks == everyone else f"{problem} (seen by {_ranks_text(ranks)})"
        for problem, ranks in seen_by.items()
    )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
