"""Apply a bucket plan: merge each bucket's collectives into one collective on a flat buffer.

All-gather bucket (members `x_i`, this rank's shards, `n_i` elements each, same group and dtype):

    flat = cat([x_1.reshape(-1), ..., x_k.reshape(-1)])        # [N]          copy-in
    out  = wait(all_gather_into_tensor(flat, world, group))     # [world * N]
    x_i_full = out.view(world, N)[:, off_i : off_i + n_i]       # [world, n_i] copy-out
                  .reshape(world * rows_i, *rest_i)             # what the member's wait returned

Reduce-scatter bucket (members `y_i`, full gradients `[world * rows_i, *rest_i]`):

    flat = cat([y_i.reshape(world, n_i) ...], dim=1).reshape(-1)   # [world * N], rank chunks interleaved
    out  = wait(reduce_scatter_tensor(flat, op, world, group))     # [N]
    y_i_shard = out[off_i : off_i + n_i].reshape(rows_i, *rest_i)

Both are pure data movement around the same collective, so results are bitwise equal to the
unbucketed graph; bytes moved are preserved (the sum of the members'). The merged collective is
placed where the bucket's first all-gather (last reduce-scatter) was, unless a member's input depends
on another member's result (then merging would form a cycle and the bucket is left as it is), then a stable topological
sort moves anything that depends on it after it. Copy-in / copy-out are plain aten ops here; the
kernels issue replaces them with fused Triton ops. All-reduce buckets are the same as
reduce-scatter ones without the interleave.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx

from simplefsdp._compat import stable_topological_sort, tree_leaves
from simplefsdp.passes.collectives import search
from simplefsdp.passes.detect import FsdpAllGather, FsdpReduction
from simplefsdp.passes.plan import Bucket

__all__ = ["apply_all_gather_buckets", "apply_reduction_buckets", "independent"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    """Add `target(*args)` and fill `meta["val"]` by running it on the arguments' fake values."""
    node = graph.call_function(target, args)
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    fake_mode = next(v.fake_mode for v in tree_leaves(vals) if hasattr(v, "fake_mode"))
    with fake_mode:
        node.meta["val"] = target(*vals)
    return node


def _getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, i))
    item.meta["val"] = node.meta["val"][i]
    return item


def _shape(node: fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def independent(members: Sequence[FsdpAllGather | FsdpReduction]) -> bool:
    """True if no member's input depends on another member's result: merging them cannot form a cycle."""
    results = {m.collective for m in members} | {m.wait for m in members}
    return not any(
        search(m.collective.args[0], found=results.__contains__, expand=lambda n: n.all_input_nodes) for m in members
    )


Member = FsdpAllGather | FsdpReduction


def _apply(
    graph: fx.Graph,
    items: Sequence[Member],
    buckets: Sequence[Bucket],
    merge: Callable[[fx.Graph, list[Member]], list[fx.Node]],
) -> int:
    """For each mergeable bucket, `merge` builds the merged collective and returns one replacement per
    member (the value its wait produced); the members are then removed. Returns collectives removed."""
    removed = 0
    for bucket in buckets:
        members = [items[i] for i in bucket.members]
        if len(members) < 2 or not independent(members):
            continue
        for member, replacement in zip(members, merge(graph, members), strict=True):
            member.wait.replace_all_uses_with(replacement)
        for member in members:
            graph.erase_node(member.wait)
            graph.erase_node(member.collective)
        removed += len(members) - 1
    stable_topological_sort(graph)
    return removed


def _split_out(graph: fx.Graph, flat: fx.Node, sizes: list[int], dim: int, members: list[Member]) -> list[fx.Node]:
    """Split `flat` along `dim` into `sizes` and reshape each piece like the member's original result."""
    pieces = _call(graph, aten.split_with_sizes.default, flat, sizes, dim)
    return [
        _call(graph, aten.reshape.default, _getitem(graph, pieces, i), _shape(member.wait))
        for i, member in enumerate(members)
    ]


def _merge_all_gathers(graph: fx.Graph, members: list[FsdpAllGather]) -> list[fx.Node]:
    world, group = members[0].group_size, members[0].group_name
    # [Note: rank-independent placement] Ranks holding a smaller shard of an uneven parameter pad
    # it first, and that pad node sits wherever the parameter is first used. Left there, it would
    # drag the merged collective to a rank-dependent position (ranks would then issue collectives in
    # different orders: a mismatch). The cast / pad chains read only graph inputs, so they move up
    # to the merged collective on every rank.
    anchor = members[0].collective
    for member in members:
        for node in member.prep:
            anchor.prepend(node)
    inputs = [m.collective.args[0] for m in members]
    sizes = [math.prod(_shape(x)) for x in inputs]
    with graph.inserting_before(members[0].collective):
        flat = _call(graph, aten.cat.default, [_call(graph, aten.reshape.default, x, [-1]) for x in inputs])
        gathered = _call(graph, c10d.all_gather_into_tensor.default, flat, world, group)
        per_rank = _call(graph, aten.reshape.default, _call(graph, c10d.wait_tensor.default, gathered), [world, -1])
        return _split_out(graph, per_rank, sizes, 1, members)


def _merge_reductions(graph: fx.Graph, members: list[FsdpReduction]) -> list[fx.Node]:
    first = members[0]
    world, group, op = first.group_size, first.group_name, first.reduce_op
    inputs = [m.collective.args[0] for m in members]
    scatter = first.kind == "reduce_scatter"
    sizes = [math.prod(_shape(x)) // (world if scatter else 1) for x in inputs]
    with graph.inserting_before(members[-1].collective):
        if scatter:  # interleave rank chunks: [world, N], row r holds every member's chunk for rank r
            rows = [_call(graph, aten.reshape.default, x, [world, n]) for x, n in zip(inputs, sizes, strict=True)]
            flat = _call(graph, aten.reshape.default, _call(graph, aten.cat.default, rows, 1), [-1])
            reduced = _call(graph, c10d.reduce_scatter_tensor.default, flat, op, world, group)
        else:
            flat = _call(graph, aten.cat.default, [_call(graph, aten.reshape.default, x, [-1]) for x in inputs])
            reduced = _call(graph, c10d.all_reduce.default, flat, op, group)
        return _split_out(graph, _call(graph, c10d.wait_tensor.default, reduced), sizes, 0, members)


def apply_all_gather_buckets(graph: fx.Graph, gathers: Sequence[FsdpAllGather], buckets: Sequence[Bucket]) -> int:
    """Merge each multi-member bucket of `gathers`; returns how many collectives were removed."""
    return _apply(graph, gathers, buckets, _merge_all_gathers)


def apply_reduction_buckets(graph: fx.Graph, reductions: Sequence[FsdpReduction], buckets: Sequence[Bucket]) -> int:
    """Merge each multi-member bucket of `reductions` (all one kind); returns how many collectives were removed."""
    return _apply(graph, reductions, buckets, _merge_reductions)
