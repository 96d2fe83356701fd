"""The bucket table: one row per collective of the post-pass graphs, with the parameters it carries.

Which parameters a merged collective carries is not written on it (the bucketing pass builds new
nodes). It is recovered by following data: every FSDP collective of the graph *before* the pass is
tagged with its parameter (`detect.owner_of`), and the pass never renames the nodes a collective
reads from (the shard placeholders, the ops computing the gradients). So a pre-pass collective
belongs to the post-pass collective whose sources -- the nodes reached backwards through
data-movement ops and other collectives -- include its own sources.

Invariant: the rows are in graph order (forward, then backward), so `id` is the launch order.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import fx, nn

from simplefsdp._compat import resolve_process_group
from simplefsdp.inspect.capture import StepCapture
from simplefsdp.passes.collectives import (
    collective_dtype,
    is_all_gather,
    is_all_reduce,
    is_cast_or_pad,
    is_reduce_scatter,
    passes_value_through,
)
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.plan import find_repeated_blocks

__all__ = ["BucketRow", "bucket_table", "collective_kind", "group_of", "is_collective", "module_summary"]


def collective_kind(node: fx.Node) -> str | None:
    """ "all_gather", "reduce_scatter", "all_reduce" for a collective launch, else None."""
    if is_all_gather(node):
        return "all_gather"
    if is_reduce_scatter(node):
        return "reduce_scatter"
    if is_all_reduce(node):
        return "all_reduce"
    return None


def is_collective(node: fx.Node) -> bool:
    return collective_kind(node) is not None


def group_of(node: fx.Node) -> tuple[str, int]:
    """(process group name, size) of a collective launch; an all-reduce's size comes from the live group."""
    kind = collective_kind(node)
    if kind == "all_gather":  # (input, group_size, group_name)
        return str(node.args[2]), int(node.args[1])
    if kind == "reduce_scatter":  # (input, reduce_op, group_size, group_name)
        return str(node.args[3]), int(node.args[2])
    return str(node.args[2]), resolve_process_group(node.args[2]).size()  # (input, reduce_op, group_name)


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


def _sources(node: fx.Node) -> set[str]:
    """Names of the nodes `node`'s input comes from, looking through data movement and collectives."""
    found, stack, seen = set(), list(node.all_input_nodes), set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if passes_value_through(current) or is_cast_or_pad(current) or is_collective(current):
            stack.extend(current.all_input_nodes)
        else:
            found.add(current.name)
    return found


def _owners(pre: fx.Graph) -> list[tuple[str, set[str], str]]:
    """(kind, sources, parameter FQN) of every FSDP collective of the pre-pass graph."""
    tagged = [("all_gather", g.collective, g.owner) for g in find_fsdp_all_gathers(pre)]
    tagged += [(r.kind, r.collective, r.owner) for r in find_fsdp_reductions(pre)]
    return [(kind, _sources(node), owner) for kind, node, owner in tagged if owner]


def module_summary(modules: tuple[str, ...], *, limit: int = 3) -> str:
    """`modules` as one short string: the first `limit`, then how many more."""
    if not modules:
        return "(not FSDP)"
    shown = ", ".join(m or "(root)" for m in modules[:limit])
    return shown if len(modules) <= limit else f"{shown}, ... (+{len(modules) - limit})"


def _module_of(fqn: str, blocks: list[str]) -> str:
    block = next((b for b in blocks if fqn == b or fqn.startswith(b + ".")), None)
    return block if block is not None else fqn.rpartition(".")[0]


def _rows(graph: fx.Graph, pre: fx.Graph, phase: str, model: nn.Module, start: int) -> list[BucketRow]:
    owners = _owners(pre)
    blocks = find_repeated_blocks(model)
    numel = {fqn: p.numel() for fqn, p in model.named_parameters()}
    rows = []
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        sources = _sources(node)
        params = tuple(dict.fromkeys(o for k, s, o in owners if k == kind and s and s <= sources))
        full = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
        sent = node.args[0].meta["val"]
        rows.append(
            BucketRow(
                id=start + len(rows),
                phase=phase,
                collective=kind,
                node=node.name,
                modules=tuple(dict.fromkeys(_module_of(p, blocks) for p in params)),
                parameters=params,
                numel=sum(numel.get(p, 0) for p in params),
                nbytes=math.prod(full.shape) * full.dtype.itemsize,
                nbytes_per_rank=math.prod(sent.shape) * sent.dtype.itemsize,
                dtype=collective_dtype(node),
                group_size=group_of(node)[1],
            )
        )
    return rows


def bucket_table(capture: StepCapture) -> list[BucketRow]:
    """One row per collective the compiled step launches, forward then backward, in graph order.
    Needs the process groups the graphs name (the capture's world) to still exist."""
    forward = _rows(capture.forward, capture.forward_pre, "forward", capture.model, 0)
    return forward + _rows(capture.backward, capture.backward_pre, "backward", capture.model, len(forward))
