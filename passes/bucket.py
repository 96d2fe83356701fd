"""Apply a bucket plan: merge each bucket's collectives into one collective on a flat buffer.

All-gather bucket (members: this rank's shards `x_i`, before the cast to the gather dtype and the
zero pad of a short last shard; `chunk_i` elements each once padded):

    slot = all_gather_copy_in([x_i ...], chunks, dtype)                # [N]; cast + pad + concat
    out  = wait(all_gather_into_tensor(slot, world, group))            # [world * N]
    full = all_gather_copy_out(out, chunks, sizes, ndims, world)       # each in the shape of the
                                                                       # member's wait result (the
                                                                       # shapes, flattened)

Reduce-scatter bucket (members: full gradients `g_i`, before the cast to the reduce dtype and the
zero pad of dim 0 to a multiple of world):

    flat = reduce_scatter_copy_in([g_i ...], world, dtype, 1.0)  # [world * N], rank chunks interleaved
    out  = wait(reduce_scatter_tensor(flat, op, world, group))     # [N]
    shards = split(out, chunks)                                    # each [chunk_i], views, reshaped

On gloo the reduce-scatter is an in-place all-reduce of `flat` and a copy of this rank's slot
(`passes/backend.py`): `out = rank_slot(wait(all_reduce_(flat, op, group)), group, N)`. All-reduce
buckets are the world-1 layout of the same ops. The copy ops are simplefsdp's custom
ops (`kernels/`: Triton on GPU, torch on CPU); they only move, cast and pad, exactly as the
nodes they replace did, so results are bitwise equal to the unbucketed graph and bytes on the wire
are the members' sum. The merged collective is placed where the bucket's first all-gather (last
reduce-scatter) was, unless a member's input depends on another member's result (merging would
form a cycle: the bucket is left as it is); a stable topological sort then moves what depends on it
after it.

[Note: no rank in the graph]
The pass's output holds no rank index, so ranks whose incoming graphs are equal (even shards on a
1-D mesh) compile one graph and can share one compiled artifact (`FsdpPass.uuid`). Where a rank's
slot matters the collective or an op finds it when it runs: the all-gather sends the copy-in's
`[N]` slot and places it in its `[world * N]` output itself (out of place: the slot is the send
buffer, the output a second buffer), and gloo's in-place all-reduce is followed by `rank_slot`,
which reads the rank from the group name. The copy-in ops take no rank. The cost against writing
the slot into the output and gathering in place (`all_gather_into_tensor_out` on a view of its
own output, which needs the slot's offset in the graph): one `[N]` buffer more per bucket while
the gather is in flight; time measured in bench/results/measurements.md, "out-of-place gathers".
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx

from simplefsdp._compat import c10d_functional, stable_topological_sort, tree_leaves
from simplefsdp.kernels.copy_ops import (
    ALL_GATHER_COPY_IN,
    ALL_GATHER_COPY_OUT,
    FAKE_IMPLS,
    RANK_SLOT,
    REDUCE_SCATTER_COPY_IN,
    SUPPORTED_DTYPES,
)
from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT, QUANT_FAKE_IMPLS
from simplefsdp.kernels.reference import chunk_numel
from simplefsdp.passes.backend import reduces_in_place
from simplefsdp.passes.collectives import Collective, is_cast_or_pad
from simplefsdp.passes.detect import FsdpAllGather
from simplefsdp.passes.plan import Bucket
from simplefsdp.passes.walk import walk

logger = logging.getLogger(__name__)

__all__ = ["apply_all_gather_buckets", "apply_reduction_buckets", "independent"]

_FAKE_IMPLS = {**FAKE_IMPLS, **QUANT_FAKE_IMPLS}

aten = torch.ops.aten


def _call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """Add `target(*args, **kwargs)` and fill `meta["val"]` by running it on the arguments' fake values
    (a copy op's registered fake function directly: [Note: the copy ops' output metadata, directly])."""
    node = graph.call_function(target, args, kwargs)
    vals, kwvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    fake_mode = next(v.fake_mode for v in tree_leaves(vals) if hasattr(v, "fake_mode"))
    with fake_mode:
        node.meta["val"] = _FAKE_IMPLS.get(target, target)(*vals, **kwvals)
    return node


def _getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, i))
    item.meta["val"] = node.meta["val"][i]
    return item


def _shape(node: fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def independent(members: Sequence[Collective]) -> bool:
    """True if no member's input depends on another member's result: merging them cannot form a cycle.

    A node that depends on a result comes after it in the (topologically sorted) graph, so the walk
    back from each input stops at the first member's launch: it visits the region between the
    bucket's launches, not the whole graph before them (which made bucketing quadratic in depth)."""
    results = {m.launch for m in members} | {m.wait for m in members}
    first = min(m.launch for m in members)

    def follow(node: fx.Node) -> list[fx.Node]:
        return [i for i in node.all_input_nodes if i >= first]

    starts = [m.sent for m in members if m.sent > first]  # one walk for all: the region is visited once
    return not any(node in results for node in walk(starts, follow=follow))


def _apply(
    graph: fx.Graph,
    items: Sequence[Collective],
    buckets: Sequence[Bucket],
    merge: Callable[[fx.Graph, list[Collective]], tuple[list[fx.Node], list[fx.Node]]],
) -> int:
    """For each mergeable bucket, `merge` builds the merged collective and returns one replacement per
    member (the value its wait produced) and the cast / pad nodes it made redundant; the members
    and those nodes are then removed. Returns collectives removed."""
    removed, unsupported = 0, []
    for bucket in buckets:
        planned = [(items[i], _copy_ops_support(items[i])) for i in bucket.members]
        members = [member for member, supported in planned if supported]
        unsupported += [member for member, supported in planned if not supported and len(planned) > 1]
        if len(members) < 2 or not independent(members):
            continue
        replacements, prep = merge(graph, members)
        owned = [_own_nodes(member) for member in members]
        for member, replacement in zip(members, replacements, strict=True):
            for result in _results(member):
                result.replace_all_uses_with(replacement)
        for nodes in owned:
            for node in nodes:
                graph.erase_node(node)
        _erase_dead(graph, prep)
        removed += len(members) - 1
    if unsupported:
        logger.warning(
            "simplefsdp pass: %d collective(s) planned into buckets keep their own collective: the bucket copy "
            "ops handle %s only (%s)",
            len(unsupported),
            ", ".join(map(str, SUPPORTED_DTYPES)),
            ", ".join(f"{m.launch.name}: {_sent_dtype(m)}" for m in unsupported),
        )
    stable_topological_sort(graph)
    return removed


def _results(member: Collective) -> list[fx.Node]:
    """The nodes whose value a member's merged replacement takes over: its wait, or a quantized
    gather's dequantized tensor (the `getitem`s of its `quant_copy_out`'s one output)."""
    dequantize = getattr(member, "dequantize", None)
    return [member.wait] if dequantize is None else list(dequantize.users)


def _own_nodes(member: Collective) -> list[fx.Node]:
    """A member's nodes that go once its results are replaced, users before what they use."""
    dequantize = getattr(member, "dequantize", None)
    unpacking = [] if dequantize is None else [*dequantize.users, dequantize]
    return [*unpacking, member.wait, member.launch]


def _sent_dtype(member: Collective) -> str:
    val = member.sent.meta.get("val")
    return str(val.dtype) if isinstance(val, torch.Tensor) else "no traced metadata"


def _copy_ops_support(member: Collective) -> bool:
    """The bucket copy ops read and write `SUPPORTED_DTYPES` only: a member sending, or cast from,
    another dtype (fp64, float8) -- or whose tensors carry no traced metadata to tell -- keeps its
    own collective. A quantized gather's ops are the bucket's already."""
    if getattr(member, "dequantize", None) is not None:
        return True
    sent = member.sent
    source, _ = _unprepared(sent, pad_ok=lambda n: True)
    vals = [getattr(node, "meta", {}).get("val") for node in (sent, source)]
    return all(isinstance(v, torch.Tensor) and v.dtype in SUPPORTED_DTYPES for v in vals)


def _is_dim0_tail_pad(node: fx.Node) -> bool:
    """A zero pad that only appends rows to dim 0: in flat order, zeros after the data."""
    pad, value = node.args[1], (node.args[2] if len(node.args) > 2 else 0)
    source = node.args[0].meta["val"]
    return value == 0 and source.dim() > 0 and len(pad) == 2 * source.dim() and not any(pad[:-1])


def _pads_to_world_multiple(node: fx.Node, world: int) -> bool:
    """A dim-0 tail pad to exactly `world * chunk_numel` elements: what reduce_scatter_copy_in pads to."""
    padded = math.prod(node.meta["val"].shape)
    return _is_dim0_tail_pad(node) and padded == world * chunk_numel(node.args[0].meta["val"].shape, world)


def _unprepared(node: fx.Node, *, pad_ok: Callable[[fx.Node], bool]) -> tuple[fx.Node, list[fx.Node]]:
    """The tensor `node` was cast / zero-padded from, and those single-use cast / pad nodes: the
    bucket copy-in ops cast and pad themselves, in the same pass over memory. A pad is looked
    through only if `pad_ok` says the copy-in op pads the same way, and at most one cast that
    changes only the dtype."""
    chain, cast = [], False
    while is_cast_or_pad(node) and len(node.users) == 1:
        if node.target is aten.constant_pad_nd.default:
            if not pad_ok(node):
                break
        elif cast or not _only_changes_dtype(node):
            break  # a second cast: the copy-in casts once, and fp32 -> bf16 -> fp32 must keep its rounding
        else:
            cast = True
        chain.append(node)
        node = node.args[0]
    return node, chain


def _only_changes_dtype(cast: fx.Node) -> bool:
    """A cast that keeps device, shape and (strided) layout: what the copy-in op can do for it. A
    `_to_copy` may also move devices or change layout; those stay in the graph."""
    before, after = cast.args[0].meta["val"], cast.meta["val"]
    return before.device == after.device and before.shape == after.shape and after.layout == torch.strided


def _contiguous(graph: fx.Graph, node: fx.Node) -> fx.Node:
    if node.meta["val"].is_contiguous():
        return node
    return _call(graph, aten.clone.default, node, memory_format=torch.contiguous_format)


def _unpack(graph: fx.Graph, pieces: fx.Node, members: list[Collective]) -> list[fx.Node]:
    """Each flat piece reshaped like the member's original result (a 1-D one is the piece itself)."""
    out = []
    for i, member in enumerate(members):
        piece, shape = _getitem(graph, pieces, i), _shape(member.wait)
        out.append(piece if _shape(piece) == shape else _call(graph, aten.reshape.default, piece, shape))
    return out


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for node in nodes:  # each chain runs from the collective back to its source
        if not node.users:
            graph.erase_node(node)


def _merge_all_gathers(graph: fx.Graph, members: list[FsdpAllGather]) -> tuple[list[fx.Node], list[fx.Node]]:
    if members[0].dequantize is not None:  # the members share a merge key: all quantized alike
        return _merge_quantized_gathers(graph, members)
    # [Note: rank-independent placement] A rank holding a smaller shard of an uneven parameter pads
    # it before gathering; that pad sits wherever the parameter is first used. The copy-in op pads
    # (and casts) itself, reading the graph inputs directly, so the merged collective depends only
    # on graph inputs and lands at the same place on every rank: the graph's structure, and so
    # every ordering decision, is the same on every rank.
    world, group = members[0].group_size, members[0].group_name
    sent = [m.sent for m in members]
    chunks = [math.prod(_shape(x)) for x in sent]
    dtype = sent[0].meta["val"].dtype
    chains = [_unprepared(x, pad_ok=_is_dim0_tail_pad) for x in sent]  # copy-in pads each to its chunk
    # an offloaded member's shard reaches the copy-in through its host copy, which reads a graph
    # input only: it moves ahead of the merged copy-in (the reorder pass places it after)
    for member in members:
        for node in member.host_copy:
            if node > members[0].launch:
                members[0].launch.prepend(node)
    with graph.inserting_before(members[0].launch):
        shards = [_contiguous(graph, src) for src, _ in chains]  # the copy-in reads them flat
        slot = _call(graph, ALL_GATHER_COPY_IN, shards, chunks, dtype)
        gathered = _call(graph, c10d_functional.all_gather_into_tensor.default, slot, world, group)
        waited = _call(graph, c10d_functional.wait_tensor.default, gathered)
        # each output in its member's shape (the padded full tensor; the graph strips padding after)
        shapes = [_shape(member.wait) for member in members]
        sizes, ndims = [d for shape in shapes for d in shape], [len(shape) for shape in shapes]
        pieces = _call(graph, ALL_GATHER_COPY_OUT, waited, chunks, sizes, ndims, world)
        out = [_getitem(graph, pieces, i) for i in range(len(members))]
    return out, [node for _, chain in chains for node in chain]


def _merge_quantized_gathers(graph: fx.Graph, members: list[FsdpAllGather]) -> tuple[list[fx.Node], list[fx.Node]]:
    """One quantized bucket (module docstring's all-gather bucket, with `quant_copy_in` /
    `quant_copy_out` and a byte buffer): every member's shard and chunk as its own one-member
    `quant_copy_in` had them, every output shape as its `quant_copy_out` had it. The bytes each member
    contributes are the same codes and scales (blocks start at each member's chunk), so the merged
    bucket dequantizes to exactly the unmerged values."""
    world, group = members[0].group_size, members[0].group_name
    shards = [m.quantize.args[0][0] for m in members]
    chunks = [m.quantize.args[1][0] for m in members]
    _, _, code_dtype, block = members[0].quantize.args
    *_, dtype = members[0].dequantize.args
    for member in members:  # as for plain members: an offloaded shard's host copy moves first
        for node in member.host_copy:
            if node > members[0].launch:
                members[0].launch.prepend(node)
    with graph.inserting_before(members[0].launch):
        slot = _call(graph, QUANT_COPY_IN, shards, chunks, code_dtype, block)
        gathered = _call(graph, c10d_functional.all_gather_into_tensor.default, slot, world, group)
        waited = _call(graph, c10d_functional.wait_tensor.default, gathered)
        sizes = [d for m in members for d in m.dequantize.args[2]]
        ndims = [n for m in members for n in m.dequantize.args[3]]
        pieces = _call(graph, QUANT_COPY_OUT, waited, chunks, sizes, ndims, world, code_dtype, block, dtype)
        out = [_getitem(graph, pieces, i) for i in range(len(members))]
    return out, [m.quantize for m in members]


def _merge_reductions(graph: fx.Graph, members: list[Collective]) -> tuple[list[fx.Node], list[fx.Node]]:
    first = members[0]
    world, group, op = first.group_size, first.group_name, first.reduce_op
    sent = [m.sent for m in members]
    dtype = sent[0].meta["val"].dtype
    scatter = first.kind == "reduce_scatter"
    if scatter:
        chains = [_unprepared(x, pad_ok=lambda n: _pads_to_world_multiple(n, world)) for x in sent]
    else:  # an all-reduce bucket concatenates as they are: keep any pad
        chains = [_unprepared(x, pad_ok=lambda n: False) for x in sent]
    in_place = scatter and reduces_in_place(group)
    with graph.inserting_before(members[-1].launch):
        grads = [_contiguous(graph, src) for src, _ in chains]
        # an all-reduce bucket is the world-1 layout: plain concatenation
        flat = _call(graph, REDUCE_SCATTER_COPY_IN, grads, world if scatter else 1, dtype, 1.0)
        if in_place:  # [Note: gloo's reduce-scatter is an all-reduce of a copy] in passes/backend.py
            reduced = _call(graph, c10d_functional.all_reduce_.default, flat, op, group)
        elif scatter:
            reduced = _call(graph, c10d_functional.reduce_scatter_tensor.default, flat, op, world, group)
        else:
            reduced = _call(graph, c10d_functional.all_reduce.default, flat, op, group)
        chunks = [math.prod(_shape(x)) // (world if scatter else 1) for x in sent]
        waited = _call(graph, c10d_functional.wait_tensor.default, reduced)
        if in_place:  # this rank's slot, copied: the shards must not keep the whole buffer alive
            waited = _call(graph, RANK_SLOT, waited, group, sum(chunks))
        # each shard is a contiguous run of the reduced slot, in the same dtype: views, no copy-out
        # (the cast back to the master dtype stays where the graph has it)
        pieces = _call(graph, aten.split_with_sizes.default, waited, chunks)
        out = _unpack(graph, pieces, members)
    return out, [node for _, chain in chains for node in chain]


def apply_all_gather_buckets(graph: fx.Graph, gathers: Sequence[FsdpAllGather], buckets: Sequence[Bucket]) -> int:
    """Merge each multi-member bucket of `gathers`; returns how many collectives were removed."""
    return _apply(graph, gathers, buckets, _merge_all_gathers)


def apply_reduction_buckets(graph: fx.Graph, reductions: Sequence[Collective], buckets: Sequence[Bucket]) -> int:
    """Merge each multi-member bucket of `reductions` (all one kind); returns how many collectives were removed."""
    return _apply(graph, reductions, buckets, _merge_reductions)
