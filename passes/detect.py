"""Find the FSDP collectives in a post-grad FX graph: what the bucketing and reordering passes act on.

An FSDP all-gather is an `all_gather_into_tensor` whose input is a graph input (the sharded
parameter) seen through at most a dtype cast and a zero pad (DTensor pads the smaller shards of
an unevenly sharded parameter before gathering), and for an offloaded parameter its copy from
host memory (`kernels/host_copy.py`). An FSDP reduction is a `reduce_scatter_tensor`
or `all_reduce` whose waited result reaches a graph output (the gradient) through views, casts,
constant pads, copies and further reductions only (HYBRID chains an all-reduce and a reduce-scatter). Each is
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

from torch import fx

from simplefsdp._compat import OpOverload
from simplefsdp.kernels.host_copy import is_copy_wait
from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT
from simplefsdp.passes.collectives import (
    Collective,
    find_collectives,
    is_all_reduce,
    is_cast_or_pad,
    is_reduce_scatter,
    passes_value_through,
)
from simplefsdp.passes.walk import reaches

__all__ = ["FsdpAllGather", "find_fsdp_all_gathers", "find_fsdp_reductions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsdpAllGather(Collective):
    """An all-gather of one sharded parameter: `source` -> [prep ops] -> `launch` -> `wait`."""

    source: fx.Node  # the graph input holding this rank's shard
    prep: tuple[fx.Node, ...]  # cast / pad nodes from `source` (or the host copy) to the collective's input, in order
    # an offloaded shard: the nodes copying `source` to the device (views, copy start and wait), in order
    host_copy: tuple[fx.Node, ...] = ()
    # a quantized gather: its `quant_copy_out` (the wait's one user; `prep` ends with its `quant_copy_in`)
    dequantize: fx.Node | None = None

    @property
    def quantize(self) -> fx.Node | None:
        """A quantized gather's `quant_copy_in` node (what it sends); None for a plain gather."""
        return self.sent if self.dequantize is not None else None


def _gathered_graph_input(node: fx.Node) -> tuple[fx.Node | None, tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """The placeholder `node` (an all-gather input) comes from through cast / pad ops and, for an
    offloaded shard, its host copy; those cast / pad ops and the host copy's nodes."""
    current, prep = node, []
    while is_cast_or_pad(current):
        prep.append(current)
        current = current.args[0]
    current, host_copy = _through_host_copy(current)
    return (current if current.op == "placeholder" else None), tuple(reversed(prep)), host_copy


def _through_host_copy(node: fx.Node) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """What a host copy's wait `node` (seen through views: the shard's DTensor unwrapped and
    rewrapped) copied, and the copy's nodes in order; `node` and () when it is no host copy."""
    current, nodes = node, []
    while _is_view(current):
        nodes.append(current)
        current = current.args[0]
    if not is_copy_wait(current):
        return node, ()
    nodes += [current, current.args[0]]
    current = current.args[1]
    while _is_view(current):
        nodes.append(current)
        current = current.args[0]
    return current, tuple(reversed(nodes))


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.is_view


def _quantized_parts(gather: Collective) -> tuple[fx.Node, fx.Node] | None:
    """A one-member quantized gather's shard (the `quant_copy_in`'s input) and `quant_copy_out`; None
    for anything else (a plain gather, or a bucket already merged)."""
    sent, wait = gather.sent, gather.wait
    if sent.op != "call_function" or sent.target is not QUANT_COPY_IN or wait is None or len(sent.args[0]) != 1:
        return None
    users = list(wait.users)
    if len(users) != 1 or users[0].target is not QUANT_COPY_OUT:
        return None
    return sent.args[0][0], users[0]


def find_fsdp_all_gathers(graph: fx.Graph, *, groups: Collection[tuple[int, ...]] | None = None) -> list[FsdpAllGather]:
    found = []
    for gather in find_collectives(graph, kinds=("all_gather",), groups=groups):
        quantized = _quantized_parts(gather)
        shard, dequantize = quantized if quantized is not None else (gather.sent, None)
        views = []
        while dequantize is not None and _is_view(shard):  # the shard's DTensor unwrapped
            views.append(shard)
            shard = shard.args[0]
        source, prep, host_copy = _gathered_graph_input(shard)
        if dequantize is not None:
            prep = (*prep, *reversed(views), gather.sent)
        if source is not None and gather.wait is not None:
            found.append(
                FsdpAllGather(**_fields(gather), source=source, prep=prep, host_copy=host_copy, dequantize=dequantize)
            )
    return found


def _fields(collective: Collective) -> dict:
    return {field.name: getattr(collective, field.name) for field in dataclasses.fields(Collective)}


def _carries_reduced_value(node: fx.Node) -> bool:
    # HYBRID: one reduction feeds the other (all-reduce across replicas, reduce-scatter within),
    # through the pad of an uneven gradient (`uneven.py` folds DTensor's padding into one pad)
    return passes_value_through(node) or is_cast_or_pad(node) or is_reduce_scatter(node) or is_all_reduce(node)


def _reaches_output(wait: fx.Node) -> bool:
    return reaches(
        wait,
        found=lambda n: n.op == "output",
        follow=lambda n: n.users if n is wait or _carries_reduced_value(n) else (),
    )


def find_fsdp_reductions(graph: fx.Graph, *, groups: Collection[tuple[int, ...]] | None = None) -> list[Collective]:
    """The gradient reductions (reduce-scatters, all-reduces) whose waited result reaches a graph output."""
    return [
        reduction
        for reduction in find_collectives(graph, kinds=("reduce_scatter", "all_reduce"), groups=groups)
        if reduction.wait is not None and _reaches_output(reduction.wait)
    ]
