"""Peak memory per rank: the persistent state plus a liveness walk over the post-pass graphs.

[Note: what the estimate counts]
Persistent, from the wrapped model (exact, this rank's shards): the sharded parameters, their
sharded gradients (same dtype as the masters, from the backward until the optimizer step) and the
optimizer state (AdamW: two moments, SGD with momentum: one, per sharded element).
Transient, by the liveness walk of `simplefsdp.passes.liveness` over each graph (the walk the
pass checks its memory budget with; see [Note: what the walk counts] there). The forward ends
holding what it saves for backward ("activations"); the backward starts from them.

    peak = params + optimizer state + max(forward peak, backward peak)

where the backward peak includes the reduced gradients produced so far, and the communication
library's staging buffers while a collective is in flight when the device profile measured them
(a calibrated gloo profile does; see `passes/cost.py`). Ignored: allocator fragmentation and
caching, workspace of libraries (cuBLAS), inputs, and fusion (inductor may fuse away intermediates
this walk counts: the walk is an upper bound for the transients).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping

import torch
from torch import fx, nn

from simplefsdp.inspect.capture import StepCapture
from simplefsdp.inspect.live_bytes import local_shard
from simplefsdp.passes.liveness import GraphPeak, graph_peak

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


def _shard_bytes(param: torch.Tensor) -> int:
    local = local_shard(param)
    return local.numel() * local.dtype.itemsize


def _shard_key(param: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    local = local_shard(param)
    return tuple(local.shape), local.dtype


def _parameter_inputs(graph: fx.Graph, model: nn.Module) -> set[str]:
    """Placeholders holding parameter shards (counted once, as persistent memory, not by the walk).

    [Note: finding the parameter inputs]
    A compiled forward's inputs are not the parameters first: in inductor's graphs the model's
    buffers and the user's inputs come first, and each parameter is followed by an opaque object
    (a `FakeScriptObject`, not a tensor). Taking the first `len(parameters)` placeholders, as this
    did for the graphs of the debugging backend, missed about half the parameters of a Llama-style
    model and counted them as activations as well -- a share that changes with the number of
    blocks traced, so the dry run's extrapolations from 4-5 and 5-6 blocks disagreed. Instead the
    tensor placeholders are matched, in graph order, against this rank's parameter shards by shape
    and dtype, each shard used once. (An input shaped exactly like a parameter shard ahead of it
    would take its place: one tensor miscounted, not half the model.)"""
    wanted: Counter[tuple[tuple[int, ...], torch.dtype]] = Counter(_shard_key(p) for p in model.parameters())
    found = set()
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        key = (tuple(val.shape), val.dtype)
        if wanted[key] > 0:
            wanted[key] -= 1
            found.add(node.name)
    return found


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


def estimate_memory(
    capture: StepCapture, *, optimizer: str = "adamw", staging: Mapping[str, float] | None = None
) -> MemoryEstimate:
    """Peak memory per rank of one training step of `capture` (see [Note: what the estimate counts]);
    `staging`: per kind of collective, bytes staged per byte of its full buffer (`DeviceProfile.staging`)."""
    persistent = persistent_bytes(capture.model, optimizer=optimizer)
    forward_params = _parameter_inputs(capture.forward, capture.model)
    backward_params = {n.name for n in capture.backward.find_nodes(op="placeholder") if n.name in forward_params}
    return MemoryEstimate(
        params_bytes=persistent.params_bytes,
        grads_bytes=persistent.grads_bytes,
        optimizer_bytes=persistent.optimizer_bytes,
        forward=graph_peak(capture.forward, skip_inputs=forward_params, staging=staging),
        backward=graph_peak(capture.backward, skip_inputs=backward_params, staging=staging),
    )
