"""The functional collectives of a traced graph: one typed view of a collective node, and predicates.

The graphs torch.compile hands to aot_autograd compilers and to inductor's post-grad passes hold
collectives as `_c10d_functional` nodes: a launch (`all_gather_into_tensor[_out]`,
`reduce_scatter_tensor`, `all_reduce`) whose result is read through a `wait_tensor`.
`parse_collective(node)` decodes a launch's arguments once -- kind, process group (name, size,
member ranks), reduce op, the dtype and bytes it sends, the full buffer's bytes, its wait and the
parameter it serves -- and every pass and view (detect, reorder, cost, inspect) reads that
`Collective` instead of argument positions.

[Note: which parameter a collective serves]
`simplefsdp.gather` traces each parameter's gather under `fx.traceback.annotate`, so every node of
it -- the cast, the all-gather, its wait, and the backward's reduction -- carries
`node.meta["custom"][OWNER_KEY]` = the parameter's FQN. The bucket plans group collectives by it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Collection
from typing import Literal

import torch
import torch.distributed as dist
from torch import fx

from simplefsdp._compat import OpOverload, OpOverloadPacket, c10d_functional, resolve_process_group
from simplefsdp.gather import OWNER_KEY
from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, RANK_SLOT, REDUCE_SCATTER_COPY_IN
from simplefsdp.kernels.host_copy import COPY_START, COPY_WAIT
from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT
from simplefsdp.passes.walk import reaches

__all__ = [
    "Collective",
    "CollectiveKind",
    "collective_counts",
    "collective_kind",
    "derives_from_all_gather",
    "find_collectives",
    "group_ranks",
    "is_all_gather",
    "is_all_reduce",
    "is_bucket_copy",
    "is_cast_or_pad",
    "is_collective",
    "is_communication",
    "is_data_movement",
    "is_in_place",
    "is_reduce_scatter",
    "is_slot_copy",
    "is_view_of_input",
    "is_wait",
    "merge_repeated_waits",
    "owner_of",
    "parse_collective",
    "passes_value_through",
]

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce"]
_KIND_OF_PACKET: dict[OpOverloadPacket, CollectiveKind] = {
    c10d_functional.all_gather_into_tensor: "all_gather",
    c10d_functional.all_gather_into_tensor_out: "all_gather",
    c10d_functional.reduce_scatter_tensor: "reduce_scatter",
    c10d_functional.all_reduce: "all_reduce",
    c10d_functional.all_reduce_: "all_reduce",  # in place: a gloo bucket's reduction (passes/backend.py)
}


def _packet(node: fx.Node) -> OpOverloadPacket | None:
    """The op packet `node` calls (one attribute read: these predicates run on every node of
    graphs with tens of thousands of them, several times per pass)."""
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def is_all_gather(node: fx.Node) -> bool:
    """An all-gather launch: out-of-place, or in place on a buffer (`..._out`, what merged buckets use)."""
    return _KIND_OF_PACKET.get(_packet(node)) == "all_gather"


def is_reduce_scatter(node: fx.Node) -> bool:
    return _packet(node) is c10d_functional.reduce_scatter_tensor


def is_all_reduce(node: fx.Node) -> bool:
    """An all-reduce launch: out-of-place, or in place on its input (`all_reduce_`)."""
    return _KIND_OF_PACKET.get(_packet(node)) == "all_reduce"


def is_slot_copy(node: fx.Node) -> bool:
    """The copy of this rank's slot out of an in-place all-reduce's waited buffer: what a gloo
    reduce-scatter bucket becomes (`passes/backend.py`), the unpacking of its result."""
    if node.op != "call_function" or node.target is not torch.ops.aten.clone.default:
        return False
    slot = node.args[0]
    if not (isinstance(slot, fx.Node) and slot.target is torch.ops.aten.narrow.default):
        return False
    wait = slot.args[0]
    return isinstance(wait, fx.Node) and is_wait(wait) and _packet(wait.args[0]) is c10d_functional.all_reduce_


def is_in_place(node: fx.Node) -> bool:
    """A collective launch whose result is its input's storage (`all_reduce_`) or its `out=` buffer."""
    return _packet(node) is c10d_functional.all_reduce_ or (
        is_collective(node) and isinstance(node.kwargs.get("out"), fx.Node)
    )


def is_wait(node: fx.Node) -> bool:
    return _packet(node) is c10d_functional.wait_tensor


def is_collective(node: fx.Node) -> bool:
    """A collective launch of a kind `parse_collective` reads (not its wait)."""
    return _packet(node) in _KIND_OF_PACKET


def is_communication(node: fx.Node) -> bool:
    """Any functional-collective op -- a launch of any kind (also those `parse_collective` does not
    read, e.g. all-to-all) or a wait: work of the communication streams, not of the compute stream."""
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "_c10d_functional"


_BUCKET_COPIES = {ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, REDUCE_SCATTER_COPY_IN, QUANT_COPY_IN, QUANT_COPY_OUT}


def is_bucket_copy(node: fx.Node) -> bool:
    """One of simplefsdp's bucket copy ops (`kernels/copy_ops.py`): communication plumbing, not model compute."""
    return node.op == "call_function" and node.target in _BUCKET_COPIES


def owner_of(node: fx.Node) -> str:
    """FQN of the parameter whose gather traced `node` ([Note: which parameter a collective serves]);
    "" if unknown."""
    return node.meta.get("custom", {}).get(OWNER_KEY, "")


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.dtype.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective launch of a graph, decoded (see the module docstring).

    Invariant: `launch` is a collective launch node and `wait`, when not None, is its only user.
    """

    launch: fx.Node
    kind: CollectiveKind
    group_name: str
    group_size: int
    reduce_op: str | None  # "sum", "avg", ...; None for an all-gather
    wait: fx.Node | None  # the launch's single user, a wait_tensor; None if it has other users

    @property
    def sent(self) -> fx.Node:
        """The node whose value this rank sends."""
        return self.launch.args[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.sent.meta["val"].dtype

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends."""
        return _nbytes(self.sent.meta["val"])

    @property
    def full_nbytes(self) -> int:
        """Bytes of the full buffer: the gathered output of an all-gather, the reduced input of a reduction
        (what the alpha-beta cost model charges)."""
        return _nbytes(self.launch.meta["val"] if self.kind == "all_gather" else self.sent.meta["val"])

    @property
    def owner(self) -> str:
        return owner_of(self.launch)

    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the process group (needs that group to exist in this process)."""
        return group_ranks(self.group_name)

    def in_groups(self, groups: Collection[tuple[int, ...]] | None) -> bool:
        """On one of `groups` (each named by its members' global ranks); any group if None."""
        return groups is None or self.ranks() in groups


def group_ranks(group_name: str) -> tuple[int, ...]:
    """Global ranks of the process group a graph names (needs that group to exist in this process)."""
    return tuple(dist.get_process_group_ranks(resolve_process_group(str(group_name))))


def _single_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and is_wait(users[0]) else None


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """The kind of collective `node` launches, None if it launches none (reads no process group)."""
    return _KIND_OF_PACKET.get(_packet(node))


def parse_collective(node: fx.Node) -> Collective | None:
    """The typed view of `node` if it is a collective launch, else None. An all-reduce names no group
    size in the graph: it is read from the live process group."""
    kind = collective_kind(node)
    if kind == "all_gather":  # (input, group_size, group_name[, out=])
        reduce_op, group_size, group_name = None, node.args[1], node.args[2]
    elif kind == "reduce_scatter":  # (input, reduce_op, group_size, group_name)
        reduce_op, group_size, group_name = node.args[1:4]
    elif kind == "all_reduce":  # (input, reduce_op, group_name)
        reduce_op, group_name = node.args[1:3]
        group_size = resolve_process_group(str(group_name)).size()
    else:
        return None
    return Collective(
        launch=node,
        kind=kind,
        group_name=str(group_name),
        group_size=int(group_size),
        reduce_op=None if reduce_op is None else str(reduce_op),
        wait=_single_wait(node),
    )


def find_collectives(
    graph: fx.Graph,
    *,
    kinds: Collection[CollectiveKind] | None = None,
    groups: Collection[tuple[int, ...]] | None = None,
) -> list[Collective]:
    """The collective launches of `graph` (of `kinds`, on `groups`; all if None), in graph order.
    Looked up by target in the graph's node index, not by a walk over every node."""
    targets = [
        getattr(packet, overload)
        for packet, kind in _KIND_OF_PACKET.items()
        if kinds is None or kind in kinds
        for overload in packet.overloads()
    ]
    nodes = sorted(n for target in targets for n in graph.find_nodes(op="call_function", target=target, sort=False))
    found = [parse_collective(node) for node in nodes]
    return [collective for collective in found if collective.in_groups(groups)]


def merge_repeated_waits(graph: fx.Graph) -> int:
    """Give every collective launch that several `wait_tensor` nodes read one wait (the first in
    graph order), so that `parse_collective` sees its wait; returns how many waits were removed.

    [Note: a launch with two waits]
    Inductor eliminates common subexpressions, collectives included: when two parameters' gradients
    are the same value (a ResNet block's residual and shortcut BatchNorm biases: one sum of the same
    tensor), their two reduce-scatters become one launch read by two waits. A launch with more than
    one user has no `wait` in its `Collective`, so it would be neither bucketed nor reordered. Waiting
    twice on one launch returns the same tensor, so the second wait's readers read the first's."""
    removed = 0
    for collective in find_collectives(graph):
        waits = [user for user in collective.launch.users if is_wait(user)]
        if len(waits) < 2 or len(waits) != len(collective.launch.users):
            continue
        first, *others = sorted(waits)
        for other in others:
            other.replace_all_uses_with(first)
            graph.erase_node(other)
            removed += 1
    return removed


def collective_counts(graph: fx.Graph) -> Counter[str]:
    """How many nodes of each kind (`all_gather`, `reduce_scatter`, `all_reduce`, `wait`) `graph` has."""
    counts: Counter[str] = Counter({"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "wait": 0})
    for node in graph.nodes:
        kind = collective_kind(node) or ("wait" if is_wait(node) else None)
        if kind is not None:
            counts[kind] += 1
    return counts


_PASSTHROUGH_TARGETS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.cat.default,
    torch.ops.prims.convert_element_type.default,
    operator.getitem,
    # simplefsdp's bucket copy ops (kernels/): move, cast and pad only -- or, for a quantized gather,
    # re-encode the same values (what a gathered weight derives from, not new information)
    ALL_GATHER_COPY_IN,
    ALL_GATHER_COPY_OUT,
    REDUCE_SCATTER_COPY_IN,
    QUANT_COPY_IN,
    QUANT_COPY_OUT,
    RANK_SLOT,
    # an offloaded shard's copy to the device and its gradient's copy back (kernels/host_copy.py)
    COPY_START,
    COPY_WAIT,
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


def is_data_movement(node: fx.Node) -> bool:
    """An op that only moves, views, casts or pads data (not a wait): what may travel with a collective's
    launch, and what a shard passes through on its way to an all-gather."""
    if node.op != "call_function" or is_wait(node):
        return False
    return passes_value_through(node) or is_cast_or_pad(node)


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


def derives_from_all_gather(node: fx.Node) -> bool:
    """True if `node`'s value is an all-gather's output, seen through waits, views, casts, copies and concats.

    Used to check that a forward graph saves no gathered weight for backward (FULL_SHARD).
    """
    return reaches(node, found=is_all_gather, follow=lambda n: n.all_input_nodes if passes_value_through(n) else ())
