"""Fold DTensor's padding of an uneven gradient (split into rank chunks, pad, concatenate) into one pad.

A parameter whose dim 0 the data-parallel world does not divide is reduce-scattered from a padded
copy of its gradient: DTensor splits the gradient into the ranks' chunks, pads the short last one,
appends one zero-filled chunk per rank that holds no rows, and concatenates the `world` pieces:

    pieces = split(g, chunk)                                   # ceil(rows / chunk) views
    cat([pieces[0], ..., pad(pieces[-1], chunk - last), pad(empty, chunk), ...])   # world pieces
    reduce_scatter_tensor(cat, op, world, group)

That is `constant_pad_nd(g, [0, 0, ..., 0, world * chunk - rows])`: the rows of `g` in order, then
zeros. `fold_uneven_reductions` rewrites each such concatenation feeding a reduce-scatter into that
one pad, and the chunks, pads and split it read go if nothing else reads them.

[Note: why fold the uneven padding]
- Compile time: at 1024 ranks the 128,256-row vocabulary of Llama 3 becomes a split with 1,018
  outputs, 1,018 getitems and a 1,024-input concatenation per gradient. Inductor's partitioner and
  its post-grad fake-tensor updates map every getitem's arguments, the split's 1,018 outputs each
  time: 26 s of an 84 s (cProfiled) dry run in the first fake-tensor update alone, and the advisor
  took 278 s for Llama-3-405B at 1024 ranks, 90 s with the fold. One pad is one node.
- Run time and memory: a bucket's `reduce_scatter_copy_in` casts and pads each member itself while
  it copies it into the bucket (`bucket.py` looks through a dim-0 tail pad to a multiple of the
  world). It could not look through the concatenation, so an uneven gradient was copied twice --
  into the padded concatenation, then into the bucket -- and the concatenation was one more
  gradient-sized buffer. After the fold it is copied once, straight from the gradient.
Where it runs: `install.running` puts `FoldUnevenPadding` first in inductor's
`joint_custom_pre_pass`, so the partitioner and everything after it see the pad, whenever a
wrapped model compiles with its passes on and whenever a step's graphs are recorded
(`inspect/record.py`: `simplefsdp inspect`, the train command's first step), passes on or off --
without a bucket, the pad and the concatenation write the same bytes into one buffer of the same
size and lifetime, so a pass-off trace costs the same either way.
`FsdpPass` folds again first thing, for backends that run no joint-graph pass
(`simplefsdp_aot_eager`) and for graphs handed to it directly; on a graph folded already it finds
nothing. The rewrite is exact: the pad holds the same values, in the same dtype,
shape and strides, as the concatenation (checked on the nodes' fake values before a node is
replaced).
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx

from simplefsdp.passes.collectives import is_cast_or_pad, is_reduce_scatter

__all__ = ["fold_padded_split", "fold_uneven_reductions"]

aten = torch.ops.aten
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_REMOVABLE = {
    *_SPLITS,
    operator.getitem,
    aten.constant_pad_nd.default,
    aten.full.default,
    aten.new_zeros.default,
    aten.zeros.default,
}


def _val(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _split_dim(split: fx.Node) -> int | None:
    source = _val(split.args[0])
    if source is None:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return dim % source.dim()


def _tail_pad(node: fx.Node, dim: int) -> fx.Node | None:
    """The input of `node` if `node` is a zero pad that only appends along `dim`, else None."""
    if node.op != "call_function" or node.target is not aten.constant_pad_nd.default:
        return None
    source, pad = node.args[0], list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if _val(source) is None:
        return None
    ndim = _val(source).dim()
    # constant_pad_nd's pad list runs from the last dim backwards: (before, after) per dim
    after = 2 * (ndim - 1 - dim) + 1
    if value != 0 or len(pad) > 2 * ndim or after >= len(pad) or pad[after] < 0:
        return None
    return source if not any(p for i, p in enumerate(pad) if i != after) else None


def _is_zeros(node: fx.Node, dim: int) -> bool:
    """A piece of zeros: a zero pad along `dim` of a tensor with no rows along `dim`."""
    source = _tail_pad(node, dim)
    return source is not None and _val(source) is not None and _val(source).shape[dim] == 0


def _split_source(pieces: list[fx.Node], dim: int) -> fx.Node | None:
    """The tensor `pieces` are the padded chunks of (then zeros), if they are: every output of one
    split along `dim`, in order, the last one maybe zero-padded along `dim`, then zero pieces."""
    first = pieces[0]
    if first.op != "call_function" or first.target is not operator.getitem:
        return None
    split = first.args[0]
    if not isinstance(split, fx.Node) or split.target not in _SPLITS or _split_dim(split) != dim:
        return None
    chunks = split.meta.get("val")
    count = len(chunks) if isinstance(chunks, (list, tuple)) else None
    if count is None or len(pieces) < count:
        return None
    for index, piece in enumerate(pieces[:count]):
        if index == count - 1 and _tail_pad(piece, dim) is not None:
            piece = _tail_pad(piece, dim)
        if piece.target is not operator.getitem or piece.args != (split, index):
            return None
    if not all(_is_zeros(piece, dim) for piece in pieces[count:]):
        return None
    return split.args[0]


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase `nodes` and what they read, as long as nothing reads them (placeholders stay)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op != "call_function" or node.target not in _REMOVABLE:
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def fold_padded_split(graph: fx.Graph, cat: fx.Node) -> fx.Node | None:
    """Replace `cat` (an `aten.cat` of a split tensor's padded chunks, then zeros) by one zero pad of
    that tensor; returns the pad, or None (graph unchanged) if `cat` is not such a concatenation or
    the pad's value would differ from it in dtype, shape or strides."""
    if cat.op != "call_function" or cat.target is not aten.cat.default or _val(cat) is None:
        return None
    pieces = list(cat.args[0])
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % _val(cat).dim()
    source = _split_source(pieces, dim) if pieces and all(isinstance(p, fx.Node) for p in pieces) else None
    if source is None or _val(source) is None:
        return None
    value, want = _val(source), _val(cat)
    extra = want.shape[dim] - value.shape[dim]
    pad = [0, 0] * (value.dim() - 1 - dim) + [0, extra]
    with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
        padded = aten.constant_pad_nd.default(value, pad, 0.0)
    if (padded.dtype, padded.shape, padded.stride()) != (want.dtype, want.shape, want.stride()):
        return None
    with graph.inserting_before(cat):
        node = graph.call_function(aten.constant_pad_nd.default, (source, pad, 0.0))
    node.meta.update({k: v for k, v in cat.meta.items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = padded
    cat.replace_all_uses_with(node)
    graph.erase_node(cat)
    _erase_dead(graph, pieces)
    return node


def fold_uneven_reductions(graph: fx.Graph) -> int:
    """Fold every concatenation that only reduce-scatters read (directly, or through a cast to the
    reduce dtype) and `fold_padded_split` accepts; returns how many were folded. See [Note: why fold
    the uneven padding]."""
    cats = list(graph.find_nodes(op="call_function", target=aten.cat.default))
    return sum(1 for cat in cats if _feeds_reductions(cat) and fold_padded_split(graph, cat) is not None)


def _feeds_reductions(node: fx.Node) -> bool:
    """Every reader of `node` is a reduce-scatter, or a cast (the gradient cast to the reduce dtype)
    that only reduce-scatters read."""
    return bool(node.users) and all(
        is_reduce_scatter(user) or (_is_cast(user) and _feeds_reductions(user)) for user in node.users
    )


def _is_cast(node: fx.Node) -> bool:
    return is_cast_or_pad(node) and node.target is not aten.constant_pad_nd.default
