"""Gradient accumulation without a reduction per micro-batch: `with simplefsdp.no_sync(model): ...`.

    for i, micro_batch in enumerate(micro_batches):
        with simplefsdp.no_sync(model, enabled=i < len(micro_batches) - 1):
            loss_fn(model, micro_batch).backward()   # the last backward reduces everything
    optimizer.step()

[Note: how gradients skip the reduction]
Inside `no_sync`, a parameter is gathered from a detached copy of its shard, so autograd has no
path back to the shard and no reduce-scatter runs. The full tensor is passed through `_Tap`, an
identity whose backward hands the gradient to a per-parameter "sink": a leaf tensor of the full
shape with all strides 0 (one element of storage), so autograd accumulates the unsharded
gradient in `sink.grad`, in the reduction dtype, across micro-batches for free. Leaving `no_sync`
moves `sink.grad` into `pending`. The next forward outside `no_sync` gathers normally and passes
the full tensor through `_AddPending`, whose backward adds the pending sum to the gradient before
the one reduction, in the reduction dtype (see [Note: the deferred sum meets the gradient in
reduce_dtype] in `gather.py`).

Costs: while deferring, each rank holds every trainable parameter's full gradient in the
reduction dtype (as DDP and FSDP do in `no_sync`), on top of the sharded model. The default --
a plain backward per micro-batch -- reduces every time instead: more communication, only sharded
gradients in memory. With `param_dtype` narrower than `reduce_dtype`, the forward that takes the
pending sums gathers in `reduce_dtype` (see the note in `gather.py`).

Compiled, the deferring flag and the presence of pending gradients are guarded: a model compiles
at most three variants (deferring, reducing with pending gradients, plain) and then reuses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.class_swap import user_class

__all__ = ["Accumulation", "add_pending", "attach", "no_sync", "tap"]

_STATE_ATTR = "_simplefsdp_accumulation"


@dataclasses.dataclass(eq=False)
class Accumulation:
    """One wrapped model's accumulation state, shared by all of its parameters' gather specs."""

    depth: int = 0  # open no_sync blocks; deferring while > 0
    params: dict[str, tuple[DTensor, torch.dtype]] = dataclasses.field(default_factory=dict)  # fqn -> grad dtype
    sinks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> zero-stride leaf
    pending: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> unreduced sum

    @property
    def deferring(self) -> bool:
        return self.depth > 0

    def take_pending(self, fqn: str) -> torch.Tensor | None:
        """The deferred gradient sum of parameter `fqn`, removed from the state (None if there is none)."""
        return self.pending.pop(fqn, None)

    def add_parameter(self, fqn: str, param: DTensor, *, grad_dtype: torch.dtype) -> None:
        """Track `param`, whose deferred gradient accumulates in `grad_dtype`."""
        self.params[fqn] = (param, grad_dtype)

    def make_sinks(self) -> None:
        """A sink per parameter on its current device (built once, so compiled graphs see the same
        leaves; rebuilt only if the parameter moved, e.g. from meta by `materialize`): a leaf of
        the full shape in the gradient dtype, one element of storage."""
        for fqn, (param, grad_dtype) in self.params.items():
            device = param.to_local().device
            if fqn not in self.sinks or self.sinks[fqn].device != device:
                sink = torch.empty_strided(param.shape, (0,) * param.ndim, dtype=grad_dtype, device=device)
                self.sinks[fqn] = sink.requires_grad_()


class _Tap(torch.autograd.Function):
    """Identity on `full`; the gradient goes to `sink` instead (and none to `full`)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        ctx.sink_dtype = sink.dtype
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.to(ctx.sink_dtype)


class _AddPending(torch.autograd.Function):
    """Identity on `full`; its gradient gets `pending` added, in the wider of the two dtypes (the
    caller gives `full` a dtype at least as wide as `pending`'s, so nothing is rounded here)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pending)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (pending,) = ctx.saved_tensors
        return grad + pending, None


def tap(full: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """`full`, whose gradient accumulates in `sink.grad` instead of flowing back (see the module note)."""
    return _Tap.apply(full, sink)


def add_pending(full: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """`full`, whose gradient gets the deferred sum `pending` added before the reduction."""
    return _AddPending.apply(full, pending)


def attach(model: nn.Module, state: Accumulation) -> None:
    """Make `state` the one `no_sync(model)` uses."""
    setattr(model, _STATE_ATTR, state)


def _collect(state: Accumulation) -> None:
    for fqn, sink in state.sinks.items():
        if sink.grad is not None:
            grad, sink.grad = sink.grad, None
            state.pending[fqn] = state.pending[fqn] + grad if fqn in state.pending else grad


@contextlib.contextmanager
def no_sync(model: nn.Module, *, enabled: bool = True) -> Iterator[None]:
    """Inside the block, backward passes accumulate unsharded gradients without reducing them; the
    first backward after it reduces them together with its own (see the module note).

    `enabled=False` makes the block a no-op, for `with no_sync(model, enabled=not last): ...` loops.
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"simplefsdp.no_sync() needs the model simplefsdp.wrap() returned; {user_class(model).__name__} "
            "is not a wrapped root"
        )
    if not enabled:
        yield
        return
    state.make_sinks()
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if not state.deferring:
            _collect(state)
