"""Small predicates over FX nodes for the functional collectives simplefsdp's graphs contain.

These work on the graphs torch.compile hands to aot_autograd compilers and to inductor's
post-grad passes: nodes whose target is a `torch.ops._c10d_functional` overload.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import fx

import simplefsdp.kernels  # noqa: F401  (registers torch.ops.simplefsdp.*)
from simplefsdp._compat import OpOverload, OpOverloadPacket

__all__ = [
    "collective_counts",
    "collective_dtype",
    "derives_from_all_gather",
    "is_all_gather",
    "is_all_reduce",
    "is_cast_or_pad",
    "is_reduce_scatter",
    "is_view_of_input",
    "is_wait",
    "passes_value_through",
    "search",
]

_c10d = torch.ops._c10d_functional


def _is_call(node: fx.Node, packet: OpOverloadPacket) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) is packet


def is_all_gather(node: fx.Node) -> bool:
    """An all-gather launch: out-of-place, or in place on a buffer (`..._out`, what merged buckets use)."""
    return _is_call(node, _c10d.all_gather_into_tensor) or _is_call(node, _c10d.all_gather_into_tensor_out)


def is_reduce_scatter(node: fx.Node) -> bool:
    return _is_call(node, _c10d.reduce_scatter_tensor)


def is_all_reduce(node: fx.Node) -> bool:
    return _is_call(node, _c10d.all_reduce)


def is_wait(node: fx.Node) -> bool:
    return _is_call(node, _c10d.wait_tensor)


_KINDS = {
    "all_gather": is_all_gather,
    "reduce_scatter": is_reduce_scatter,
    "all_reduce": is_all_reduce,
    "wait": is_wait,
}


def collective_counts(gm: fx.GraphModule) -> Counter[str]:
    """How many nodes of each collective kind (`all_gather`, `reduce_scatter`, `all_reduce`, `wait`) `gm` has."""
    counts: Counter[str] = Counter({kind: 0 for kind in _KINDS})
    for node in gm.graph.nodes:
        for kind, predicate in _KINDS.items():
            if predicate(node):
                counts[kind] += 1
    return counts


def collective_dtype(node: fx.Node) -> torch.dtype:
    """dtype of the tensor a collective node sends (its first argument), from the traced metadata."""
    return node.args[0].meta["val"].dtype


_PASSTHROUGH_TARGETS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.cat.default,
    torch.ops.prims.convert_element_type.default,
    operator.getitem,
    # simplefsdp's bucket copy ops (kernels/): move, cast and pad only
    torch.ops.simplefsdp.all_gather_copy_in.default,
    torch.ops.simplefsdp.all_gather_copy_out.default,
    torch.ops.simplefsdp.reduce_scatter_copy_in.default,
    torch.ops.simplefsdp.reduce_scatter_copy_out.default,
}


_CAST_OR_PAD = {
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.constant_pad_nd.default,
}


def is_cast_or_pad(node: fx.Node) -> bool:
    """A dtype cast or a constant pad: what may sit between a sharded parameter and its all-gather."""
    return node.op == "call_function" and node.target in _CAST_OR_PAD


def passes_value_through(node: fx.Node) -> bool:
    """True for ops that only move, view or cast their input: no new information from other tensors."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in _PASSTHROUGH_TARGETS or is_wait(node):
        return True
    return isinstance(target, OpOverload) and target.is_view


_RESHAPES = {torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def is_view_of_input(node: fx.Node) -> bool:
    """True if `node`'s output shares its first input's storage: a view op, `getitem` (one output of
    a multi-output op), or a reshape of a contiguous tensor. Reshapes are decided first: reshape's
    schema declares an alias, but it copies an input it cannot view."""
    if node.op != "call_function":
        return False
    if node.target in _RESHAPES:
        source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        return isinstance(source, torch.Tensor) and source.is_contiguous()
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def search(start: fx.Node, *, found: Callable[[fx.Node], bool], expand: Callable[[fx.Node], Iterable[fx.Node]]) -> bool:
    """Depth-first search from `start`: True once a node satisfies `found`; `expand` gives the next nodes."""
    stack, seen = [start], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if found(current):
            return True
        stack.extend(expand(current))
    return False


def derives_from_all_gather(node: fx.Node) -> bool:
    """True if `node`'s value is an all-gather's output, seen through waits, views, casts, copies and concats.

    Used to check that a forward graph saves no gathered weight for backward (FULL_SHARD).
    """
    return search(node, found=is_all_gather, expand=lambda n: n.all_input_nodes if passes_value_through(n) else ())
