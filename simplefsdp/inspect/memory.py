"""Peak memory per rank: the persistent state plus a liveness walk over the post-pass graphs.

[Note: what the estimate counts]
Persistent, from the wrapped model (exact, this rank's shards): the sharded parameters, their
sharded gradients (same dtype as the masters, from the backward until the optimizer step) and the
optimizer state (AdamW: two moments, SGD with momentum: one, per sharded element).
Transient, by walking each graph in node order: a node's output is allocated when it runs and
freed after its last use (graph outputs live to the end, a backward input from its start to its
last use), as inductor's generated code frees buffers. Views (a reshape of a contiguous tensor
among them), `getitem`, `wait_tensor` and in-place collectives alias their input's storage instead
of allocating. The forward ends holding
what it saves for backward ("activations"); the backward starts from them. Live bytes are split
into gathered parameters / communication buffers (outputs of all-gathers, the bucket copy ops,
and values derived only from gathered weights), reduced gradients (outputs of reduce-scatters /
all-reduces) and activations (everything else).

    peak = params + optimizer state + max(forward peak, backward peak)

where the backward peak includes the reduced gradients produced so far. Ignored: allocator
fragmentation and caching, workspace of libraries (cuBLAS, NCCL), inputs, and fusion (inductor
may fuse away intermediates this walk counts: the walk is an upper bound for the transients).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from simplefsdp._compat import tree_leaves
from simplefsdp.inspect.capture import StepCapture
from simplefsdp.passes.collectives import (
    derives_from_all_gather,
    is_all_gather,
    is_all_reduce,
    is_bucket_copy,
    is_reduce_scatter,
    is_view_of_input,
    is_wait,
)

__all__ = [
    "OPTIMIZER_STATES",
    "GraphPeak",
    "MemoryEstimate",
    "Persistent",
    "estimate_memory",
    "graph_peak",
    "persistent_bytes",
]

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per parameter, shaped like it


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPeak:
    """Liveness result for one graph: bytes at its peak, by kind, and the most ever held by comm buffers."""

    peak_bytes: int
    at_peak: dict[str, int]  # "activations", "gathered / comm buffers", "reduced gradients"
    max_comm_bytes: int
    end_bytes: int  # live at the end (the forward: what it saves for backward and returns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    forward: GraphPeak
    backward: GraphPeak

    @property
    def activations_bytes(self) -> int:
        """What the forward hands to the backward (saved tensors and outputs)."""
        return self.forward.end_bytes

    @property
    def transient_bytes(self) -> int:
        """The larger of the two graphs' peaks (the backward's includes the gradients reduced so far)."""
        return max(self.forward.peak_bytes, self.backward.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.params_bytes + self.optimizer_bytes + self.transient_bytes

    @property
    def max_in_flight_bytes(self) -> int:
        return max(self.forward.max_comm_bytes, self.backward.max_comm_bytes)


def _nbytes(node: fx.Node) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))


def _alias_of(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node`'s output shares, or None if it allocates its own."""
    if node.op != "call_function":
        return None
    if "out" in node.kwargs and isinstance(node.kwargs["out"], fx.Node):  # in-place collective on a buffer
        return node.kwargs["out"]
    if is_wait(node) or is_view_of_input(node):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    return None


def _kind(root: fx.Node) -> str:
    if is_reduce_scatter(root) or is_all_reduce(root):
        return "reduced gradients"
    if is_all_gather(root) or is_bucket_copy(root) or derives_from_all_gather(root):
        return "gathered / comm buffers"
    return "activations"


def graph_peak(graph: fx.Graph, *, skip_inputs: set[str] = frozenset()) -> GraphPeak:
    """Walk `graph` as in [Note: what the estimate counts]; placeholders named in `skip_inputs`
    (e.g. the parameter shards, counted as persistent) are not counted."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    root = {}
    for node in nodes:
        alias = _alias_of(node)
        root[node] = root.get(alias, alias) if alias is not None else node
    last_use = {}
    for node in nodes:
        for user in node.users:
            last_use[root[node]] = max(last_use.get(root[node], 0), position[user])
    output = nodes[-1]
    for value in output.all_input_nodes:  # returned values live to the end
        last_use[root[value]] = len(nodes)
    counted = {n for n in nodes if root[n] is n and n.op != "output" and n.name not in skip_inputs}
    frees: dict[int, list[fx.Node]] = {}
    for node in counted:
        frees.setdefault(last_use.get(node, position[node]), []).append(node)
    kinds = {node: _kind(node) for node in counted}
    held: dict[str, int] = {}
    peak, at_peak, max_comm = 0, {}, 0
    for i, node in enumerate(nodes):
        if node in counted:
            held[kinds[node]] = held.get(kinds[node], 0) + _nbytes(node)
        total = sum(held.values())
        max_comm = max(max_comm, held.get("gathered / comm buffers", 0))
        if total > peak:
            peak, at_peak = total, dict(held)
        for freed in frees.get(i, ()):
            held[kinds[freed]] -= _nbytes(freed)
    return GraphPeak(peak_bytes=peak, at_peak=at_peak, max_comm_bytes=max_comm, end_bytes=sum(held.values()))


def _shard_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.dtype.itemsize


def _parameter_inputs(graph: fx.Graph, model: nn.Module) -> set[str]:
    """Placeholders holding parameter shards: the forward's first inputs, one per parameter (Dynamo
    lifts parameters before user inputs), and in the backward the forward inputs saved for it."""
    count = sum(1 for _ in model.parameters())
    placeholders = [n.name for n in graph.find_nodes(op="placeholder")]
    return {name for name in placeholders[:count] if name.startswith("primals")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Persistent:
    """This rank's share of what outlives a step: parameter shards, gradient shards, optimizer state."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")


def persistent_bytes(model: nn.Module, *, optimizer: str = "adamw") -> Persistent:
    """Per-rank persistent memory of a wrapped `model` (rank 0's shards, the largest when uneven)."""
    check_optimizer(optimizer)
    params = list(model.parameters())
    trainable = sum(_shard_bytes(p) for p in params if p.requires_grad)
    return Persistent(
        params_bytes=sum(_shard_bytes(p) for p in params),
        grads_bytes=trainable,
        optimizer_bytes=OPTIMIZER_STATES[optimizer] * trainable,
    )


def estimate_memory(capture: StepCapture, *, optimizer: str = "adamw") -> MemoryEstimate:
    """Peak memory per rank of one training step of `capture` (see [Note: what the estimate counts])."""
    persistent = persistent_bytes(capture.model, optimizer=optimizer)
    forward_params = _parameter_inputs(capture.forward, capture.model)
    backward_params = {n.name for n in capture.backward.find_nodes(op="placeholder") if n.name in forward_params}
    return MemoryEstimate(
        params_bytes=persistent.params_bytes,
        grads_bytes=persistent.grads_bytes,
        optimizer_bytes=persistent.optimizer_bytes,
        forward=graph_peak(capture.forward, skip_inputs=forward_params),
        backward=graph_peak(capture.backward, skip_inputs=backward_params),
    )
