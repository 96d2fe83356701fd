"""Find the FSDP collectives in a post-grad FX graph: what the bucketing and reordering passes act on.

An FSDP all-gather is an `all_gather_into_tensor` whose input is a graph input (the sharded
parameter) seen through at most a dtype cast and a zero pad (DTensor pads the smaller shards of
an unevenly sharded parameter before gathering). An FSDP reduction is a `reduce_scatter_tensor`
or `all_reduce` whose waited result reaches a graph output (the gradient) through views, casts,
copies and further reductions only (HYBRID chains an all-reduce and a reduce-scatter). Each is
paired with its single `wait_tensor`. Everything else -- a user's own collectives,
tensor-parallel collectives on activations -- is not a candidate.

`groups` narrows both to collectives on the given process groups, each named by its members'
global ranks (a group's name is not stable: torch caches DTensor specs by value, so a graph can
carry the name of an equal, earlier mesh's group). A wrapped model's pass passes its data-parallel
mesh's groups, which is what keeps out the tp reduction of a tensor-parallel parameter's gradient
(a `Partial` over tp, e.g. a sequence-parallel norm's weight): it too reaches a gradient output,
but it is tensor parallelism's, not ours.

Invariant: the result lists are in graph order, so every rank, tracing the same program, finds
the same candidates in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import fx

from simplefsdp._compat import resolve_process_group
from simplefsdp.gather import OWNER_KEY
from simplefsdp.passes.collectives import (
    is_all_gather,
    is_all_reduce,
    is_cast_or_pad,
    is_reduce_scatter,
    is_wait,
    passes_value_through,
    search,
)

__all__ = [
    "FsdpAllGather",
    "FsdpReduction",
    "find_fsdp_all_gathers",
    "find_fsdp_reductions",
    "group_ranks",
    "owner_of",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Collective:
    collective: fx.Node
    wait: fx.Node  # the single wait_tensor of `collective`
    group_name: str
    group_size: int

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the tensor this rank sends."""
        return self.collective.args[0].meta["val"].dtype

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends."""
        sent = self.collective.args[0].meta["val"]
        return sent.numel() * sent.dtype.itemsize

    @property
    def owner(self) -> str:
        return owner_of(self.collective)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsdpAllGather(_Collective):
    """An all-gather of one sharded parameter: `source` -> [prep ops] -> `collective` -> `wait`."""

    source: fx.Node  # the graph input holding this rank's shard
    prep: tuple[fx.Node, ...]  # cast / pad nodes from `source` to the collective's input, in order


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsdpReduction(_Collective):
    """A gradient reduction (reduce-scatter or all-reduce) whose waited result reaches a graph output."""

    kind: str  # "reduce_scatter" or "all_reduce"
    reduce_op: str


def owner_of(node: fx.Node) -> str:
    """FQN of the parameter whose gather traced `node` (see `simplefsdp.gather.OWNER_KEY`); "" if unknown."""
    return node.meta.get("custom", {}).get(OWNER_KEY, "")


def _common(node: fx.Node, wait: fx.Node, group_name: object, group_size: object) -> dict:
    return {"collective": node, "wait": wait, "group_name": str(group_name), "group_size": int(group_size)}


def _single_wait(node: fx.Node) -> fx.Node | None:
    waits = [user for user in node.users if is_wait(user)]
    return waits[0] if len(waits) == 1 and len(node.users) == 1 else None


def _gathered_graph_input(node: fx.Node) -> tuple[fx.Node | None, tuple[fx.Node, ...]]:
    """The placeholder `node` (an all-gather input) comes from through cast / pad ops, and those ops."""
    current, prep = node, []
    while is_cast_or_pad(current):
        prep.append(current)
        current = current.args[0]
    return (current if current.op == "placeholder" else None), tuple(reversed(prep))


def group_ranks(group_name: object) -> tuple[int, ...]:
    """The global ranks of the process group a collective names."""
    return tuple(dist.get_process_group_ranks(resolve_process_group(str(group_name))))


def _on(group_name: object, groups: Collection[tuple[int, ...]] | None) -> bool:
    return groups is None or group_ranks(group_name) in groups


def find_fsdp_all_gathers(graph: fx.Graph, *, groups: Collection[tuple[int, ...]] | None = None) -> list[FsdpAllGather]:
    found = []
    for node in graph.nodes:
        if not is_all_gather(node) or not _on(node.args[2], groups):
            continue
        (source, prep), wait = _gathered_graph_input(node.args[0]), _single_wait(node)
        if source is None or wait is None:
            continue
        group_size, group_name = node.args[1], node.args[2]
        found.append(
            FsdpAllGather(
                collective=node,
                wait=wait,
                group_name=str(group_name),
                group_size=int(group_size),
                source=source,
                prep=prep,
            )
        )
    return found


def _carries_reduced_value(node: fx.Node) -> bool:
    # HYBRID: one reduction feeds the other (all-reduce across replicas, reduce-scatter within)
    return passes_value_through(node) or is_reduce_scatter(node) or is_all_reduce(node)


def _reaches_output(node: fx.Node) -> bool:
    return search(
        node,
        found=lambda n: n.op == "output",
        expand=lambda n: n.users if n is node or _carries_reduced_value(n) else (),
    )


def find_fsdp_reductions(graph: fx.Graph, *, groups: Collection[tuple[int, ...]] | None = None) -> list[FsdpReduction]:
    found = []
    for node in graph.nodes:
        if is_reduce_scatter(node):
            kind, (_, reduce_op, group_size, group_name) = "reduce_scatter", node.args[:4]
        elif is_all_reduce(node):
            kind, (_, reduce_op, group_name) = "all_reduce", node.args[:3]
            group_size = resolve_process_group(group_name).size()
        else:
            continue
        if not _on(group_name, groups):
            continue
        wait = _single_wait(node)
        if wait is None or not _reaches_output(wait):
            continue
        found.append(FsdpReduction(**_common(node, wait, group_name, group_size), kind=kind, reduce_op=str(reduce_op)))
    return found
