"""The bucket table: one row per collective of the post-pass graphs, with the parameters it carries.

Which parameters a merged collective carries is not written on it (the bucketing pass builds new
nodes). It is recovered by following data: every FSDP collective of the graph *before* the pass is
tagged with its parameter (`collectives.owner_of`), and the pass never renames the nodes a collective
reads from (the shard placeholders, the ops computing the gradients). So a pre-pass collective
belongs to the post-pass collective whose sources -- the nodes reached backwards through
data-movement ops and other collectives -- include its own sources.

Invariant: the rows are in graph order (forward, then backward), so `id` is the launch order.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from simplefsdp.blocks import block_of, find_repeated_blocks
from simplefsdp.inspect.capture import StepCapture
from simplefsdp.passes.collectives import (
    Collective,
    find_collectives,
    is_cast_or_pad,
    is_collective,
    passes_value_through,
)
from simplefsdp.passes.detect import find_fsdp_all_gathers
from simplefsdp.passes.walk import upstream

__all__ = ["BucketRow", "bucket_table", "module_summary"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketRow:
    id: int  # launch order over the forward, then the backward
    phase: str  # "forward" or "backward"
    collective: str  # "all_gather", "reduce_scatter" or "all_reduce"
    node: str  # the launch node's name in the post-pass graph
    modules: tuple[str, ...]  # the blocks / modules whose parameters it carries, in graph order
    parameters: tuple[str, ...]  # their fully qualified names
    numel: int  # elements of those parameters (full, unsharded)
    nbytes: int  # bytes of the collective's full buffer (gathered output / reduced input), padding included
    nbytes_per_rank: int  # bytes this rank sends
    dtype: torch.dtype
    group_size: int


def _carries(node: fx.Node) -> bool:
    return passes_value_through(node) or is_cast_or_pad(node) or is_collective(node)


def _sources(node: fx.Node) -> set[str]:
    """Names of the nodes `node`'s input comes from, looking through data movement and collectives."""
    return {source.name for source in upstream(node, through=_carries).boundary}


def _owners(pre: fx.Graph) -> list[tuple[str, set[str], str]]:
    """(kind, sources, parameter FQN) of every FSDP collective of the pre-pass graph."""
    tagged = [(c.kind, c.launch, c.owner) for c in [*find_fsdp_all_gathers(pre), *_reductions(pre)]]
    return [(kind, _sources(node), owner) for kind, node, owner in tagged if owner]


def _reductions(pre: fx.Graph) -> list[Collective]:
    """The reductions of a pre-pass graph, a launch read by two waits included ([Note: a launch with
    two waits]: the pass merges them, the pre-pass graph still has both)."""
    return find_collectives(pre, kinds=("reduce_scatter", "all_reduce"))


def _shared_reduction_owners(
    backward_pre: fx.Graph, forward_pre: fx.Graph, owners: list[tuple[str, set[str], str]]
) -> list[tuple[str, set[str], str]]:
    """(kind, sources, parameter FQN) for the parameters whose gradient a reduction tagged with
    another parameter carries.

    [Note: one reduction, two parameters]
    Inductor eliminates common subexpressions, collectives included ([Note: a launch with two
    waits]): one reduce-scatter can carry two parameters' gradients, tagged with one owner. The other
    parameter is found from the graphs' shapes instead: the backward returns the gradient of the
    forward's i-th input at position i, and a forward input that an FSDP all-gather reads is that
    gather's parameter."""
    inputs = {node: i for i, node in enumerate(forward_pre.find_nodes(op="placeholder"))}
    parameter_at = {
        inputs[g.source]: g.owner for g in find_fsdp_all_gathers(forward_pre) if g.owner and g.source in inputs
    }
    reduced = {owner for kind, _, owner in owners if kind != "all_gather"}
    reductions = [(r.kind, _sources(r.launch)) for r in _reductions(backward_pre) if r.owner]
    (gradients,) = backward_pre.find_nodes(op="output")[0].args
    found = []
    for i, gradient in enumerate(gradients):
        fqn = parameter_at.get(i)
        if fqn is None or fqn in reduced or not isinstance(gradient, fx.Node):
            continue
        sources = {gradient.name} | _sources(gradient)
        found.extend((kind, s, fqn) for kind, s in reductions if s and s <= sources)
    return found


def module_summary(modules: tuple[str, ...], *, limit: int = 3) -> str:
    """`modules` as one short string: the first `limit`, then how many more."""
    if not modules:
        return "(not FSDP)"
    shown = ", ".join(m or "(root)" for m in modules[:limit])
    return shown if len(modules) <= limit else f"{shown}, ... (+{len(modules) - limit})"


def _module_of(fqn: str, blocks: list[str]) -> str:
    block = block_of(fqn, blocks)
    return block if block is not None else fqn.rpartition(".")[0]


def _rows(
    graph: fx.Graph, pre: fx.Graph, phase: str, model: nn.Module, start: int, forward_pre: fx.Graph | None = None
) -> list[BucketRow]:
    owners = _owners(pre)
    if forward_pre is not None:
        owners += _shared_reduction_owners(pre, forward_pre, owners)
    blocks = find_repeated_blocks(model)
    numel = {fqn: p.numel() for fqn, p in model.named_parameters()}
    rows = []
    for collective in find_collectives(graph):
        sources = _sources(collective.launch)
        params = tuple(dict.fromkeys(o for k, s, o in owners if k == collective.kind and s and s <= sources))
        rows.append(
            BucketRow(
                id=start + len(rows),
                phase=phase,
                collective=collective.kind,
                node=collective.launch.name,
                modules=tuple(dict.fromkeys(_module_of(p, blocks) for p in params)),
                parameters=params,
                numel=sum(numel.get(p, 0) for p in params),
                nbytes=collective.full_nbytes,
                nbytes_per_rank=collective.nbytes,
                dtype=collective.dtype,
                group_size=collective.group_size,
            )
        )
    return rows


def bucket_table(capture: StepCapture) -> list[BucketRow]:
    """One row per collective the compiled step launches, forward then backward, in graph order.
    Needs the process groups the graphs name (the capture's world) to still exist."""
    forward = _rows(capture.forward, capture.forward_pre, "forward", capture.model, 0)
    backward = _rows(
        capture.backward, capture.backward_pre, "backward", capture.model, len(forward), capture.forward_pre
    )
    return forward + backward
