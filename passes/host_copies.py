"""Place the host-memory copies of offloaded shards (`kernels/host_copy.py`) so they overlap compute.

[Note: where offload copies sit]
An offloaded parameter's shard reaches its all-gather through a copy from host memory
(`copy_start` -> `copy_wait`) and its reduced gradient returns through a copy to host memory. After
the reorder pass has placed the collectives (`reorder.py`), with the gathers in order of first use
`g_0, g_1, ...`:

- the host-to-device copies of `g_j`'s shards start before the launch chain of `g_{j-1}` (so before
  the compute that runs while `g_{j-1}` is in flight), and are waited where the reorder put them:
  in `g_j`'s launch chain, right before its copy-in. On a GPU the copy then runs on its side stream
  under one more bucket's compute than the all-gather does; the price is one bucket's shards held
  on the device one bucket longer (a shard is 1/world of what the gather makes of it);
- the device-to-host copies of reduced gradients start where the graph made them (right after the
  reduction's result is cast) and are waited right before their first use, the graph's output:
  the host then blocks once, at the end of the backward, instead of after every reduction.

Copies move with the views that feed them (data movement from graph inputs or from a reduction's
result), so a move never drags compute across the graph and the graph stays topologically sorted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx

from simplefsdp.kernels.host_copy import COPY_WAIT, is_copy_start
from simplefsdp.passes.collectives import is_data_movement
from simplefsdp.passes.walk import upstream

__all__ = ["place_host_copies"]


def place_host_copies(
    graph: fx.Graph,
    gather_chains: Sequence[Sequence[fx.Node]],
    *,
    landing: Callable[[fx.Node], tuple[list[fx.Node], list[fx.Node]]],
) -> int:
    """Place the copies of `graph` as [Note: where offload copies sit] says; `gather_chains` are the
    launch chains of the graph's all-gathers (each ending in its launch), in order of first use;
    `landing(wait)` is the reorder pass's (the views unpacking a wait's result, and its other users).
    Returns how many copies moved."""
    moved = 0
    in_chains = {node for chain in gather_chains for node in chain}
    copies = [_copy_starts(chain) for chain in gather_chains]
    # each chain's first node that is not one of its copies' starts: found before anything moves
    anchors = [min(n for n in chain if n not in starts) for chain, starts in zip(gather_chains, copies, strict=True)]
    for anchor, starts in zip(anchors[:-1], copies[1:], strict=True):
        for node in sorted(n for n in starts if n > anchor):
            anchor.prepend(node)
            moved += is_copy_start(node)
    for wait in graph.find_nodes(op="call_function", target=COPY_WAIT):
        if wait in in_chains:
            continue
        unpacked, consumers = landing(wait)
        if consumers and wait.next is not min(consumers):
            for node in sorted([wait, *unpacked]):
                min(consumers).prepend(node)
            moved += 1
    return moved


def _copy_starts(chain: Sequence[fx.Node]) -> set[fx.Node]:
    """The copy starts in a launch chain and the data movement feeding them (the shards' views)."""
    found = set()
    for start in (n for n in chain if is_copy_start(n)):
        found.add(start)
        found.update(upstream(start, through=is_data_movement).inside)
    return found
