"""Gradient accumulation without a reduction per micro-batch: `with simplefsdp.no_sync(model): ...`.

    for i, micro_batch in enumerate(micro_batches):
        with simplefsdp.no_sync(model, enabled=i < len(micro_batches) - 1):
            loss_fn(model, micro_batch).backward()   # the last backward reduces everything
    optimizer.step()
    optimizer.zero_grad()

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

[Note: when deferred sums are reduced, and when they are dropped]
`.grad` behaves as under DDP's `no_sync` (or FSDP2's `set_requires_gradient_sync(False)`), where
the micro-batches' sums wait in `.grad` for the synchronizing backward:
- A sum is reduced once, by the synchronizing micro-batch: the first forward of the wrapped root
  outside `no_sync` with grad enabled. A parameter that forward uses adds its sum to its gradient
  before the reduction its backward runs anyway. The sums of the parameters it does not use are
  reduced into their `.grad` right after that forward, each by itself, through the same reduction
  (`gather.reduce_pending`). So once the synchronizing backward is done, every parameter's `.grad`
  holds all its micro-batches' reduced gradients, `optimizer.step()` can follow, and nothing is
  carried into the next step. `reduce_pending(model)` does the same on demand, for a loop whose
  last micro-batch ran inside `no_sync`.
- A sum is dropped with its parameter's `.grad`: from the end of the `no_sync` block that left it,
  a parameter with a deferred sum has a `.grad` (zeros if it had none: what is reduced so far), and
  whatever clears that -- `optimizer.zero_grad()`, `model.zero_grad()`, to None or in place, or
  `param.grad = None` -- discards the sum too, as it would discard DDP's. Whether `.grad` is still
  the same tensor with the same version counter is checked when a `no_sync` block opens or closes
  and before the synchronizing forward; a zero_grad inside an open block therefore drops only the
  sums of earlier blocks, and one between the synchronizing forward and its backward is too late
  (the sums are in the backward graph by then).

Costs: while deferring, each rank holds every trainable parameter's full gradient in the
reduction dtype (as DDP and FSDP do in `no_sync`), on top of the sharded model. The default -- a
plain backward per micro-batch -- reduces every time instead: more communication, only sharded
gradients in memory. The sharded `.grad` of a parameter with a sum is allocated when the first
`no_sync` block ends rather than by the synchronizing backward. With `param_dtype` narrower than
`reduce_dtype`, the synchronizing forward gathers in `reduce_dtype` (see the note in `gather.py`).
A parameter unused by the synchronizing micro-batch costs one all-gather and one reduction of its
own per optimizer step.

Compiled, the deferring flag and the presence of pending gradients are guarded: a model compiles
at most three variants (deferring, reducing with pending gradients, plain) and then reuses them.
The checks and the reductions of unused parameters' sums run eagerly, in the root's forward hooks
(see [Note: the hooks run eagerly]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp._compat import eager_top_frame, version_counter
from simplefsdp.class_swap import user_class

__all__ = ["Accumulation", "add_pending", "attach", "no_sync", "reduce_pending", "tap"]

_STATE_ATTR = "_simplefsdp_accumulation"


@dataclasses.dataclass(frozen=True)
class _Tracked:
    """A parameter whose gradient can be deferred: its deferred sum accumulates in `grad_dtype`, and
    `reduce(pending)` reduces a sum into `param.grad` by itself (all ranks together)."""

    param: DTensor
    grad_dtype: torch.dtype
    reduce: Callable[[torch.Tensor], None]


@dataclasses.dataclass(eq=False)
class Accumulation:
    """One wrapped model's accumulation state, shared by all of its parameters' gather specs.

    Invariant: every sum in `pending` has an entry in `watched` (rebuilt by each `collect`), and is
    valid only while its parameter's `.grad` is the watched tensor at the watched version (see the
    module's notes); entries of sums already taken are left over and ignored.
    """

    depth: int = 0  # open no_sync blocks; deferring while > 0
    params: dict[str, _Tracked] = dataclasses.field(default_factory=dict)
    sinks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> zero-stride leaf
    pending: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> unreduced sum
    watched: dict[str, tuple[weakref.ref, int]] = dataclasses.field(default_factory=dict)  # fqn -> (.grad, version)

    @property
    def deferring(self) -> bool:
        return self.depth > 0

    def synchronizing(self) -> bool:
        """Whether a root forward now is the synchronizing one: outside `no_sync`, grad enabled, sums pending."""
        return not self.deferring and torch.is_grad_enabled() and bool(self.pending)

    def take_pending(self, fqn: str) -> torch.Tensor | None:
        """The deferred gradient sum of parameter `fqn`, removed from the state (None if there is none)."""
        return self.pending.pop(fqn, None)

    def add_parameter(
        self, fqn: str, param: DTensor, *, grad_dtype: torch.dtype, reduce: Callable[[torch.Tensor], None]
    ) -> None:
        """Track `param`, whose deferred gradient accumulates in `grad_dtype` and is reduced by `reduce`."""
        self.params[fqn] = _Tracked(param, grad_dtype, reduce)

    def make_sinks(self) -> None:
        """A sink per parameter on its current device (built once, so compiled graphs see the same
        leaves; rebuilt only if the parameter moved, e.g. from meta by `materialize`): a leaf of
        the full shape in the gradient dtype, one element of storage."""
        for fqn, tracked in self.params.items():
            param = tracked.param
            device = param.to_local().device
            if fqn not in self.sinks or self.sinks[fqn].device != device:
                sink = torch.empty_strided(param.shape, (0,) * param.ndim, dtype=tracked.grad_dtype, device=device)
                self.sinks[fqn] = sink.requires_grad_()

    def drop_cleared(self) -> None:
        """Drop the sums whose parameter's `.grad` was cleared or replaced since they were deferred."""
        for fqn in [fqn for fqn in self.pending if not self._grad_unchanged(fqn)]:
            del self.pending[fqn]

    def _grad_unchanged(self, fqn: str) -> bool:
        ref, version = self.watched[fqn]
        grad = ref()
        return grad is not None and self.params[fqn].param.grad is grad and version_counter(grad) == version

    def collect(self) -> None:
        """At the end of the outermost `no_sync` block: add the sinks' gradients to the pending sums,
        and watch the `.grad` of every parameter with a sum (creating zeros where it has none)."""
        self.drop_cleared()
        for fqn, sink in self.sinks.items():
            if sink.grad is not None:
                grad, sink.grad = sink.grad, None
                self.pending[fqn] = self.pending[fqn] + grad if fqn in self.pending else grad
        self.watched = {}
        for fqn in self.pending:
            param = self.params[fqn].param
            if param.grad is None:
                with torch.no_grad():
                    param.grad = torch.zeros_like(param)
            self.watched[fqn] = (weakref.ref(param.grad), version_counter(param.grad))

    def reduce_all(self) -> None:
        """Reduce every pending sum into its parameter's `.grad` (a collective: all ranks at once)."""
        with torch.enable_grad():
            for fqn in [fqn for fqn in self.params if fqn in self.pending]:  # one order on every rank
                self.params[fqn].reduce(self.pending.pop(fqn))


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


# [Note: the hooks run eagerly]
# The checks and reductions of [Note: when deferred sums are reduced, and when they are dropped] look
# at `.grad` objects and launch collectives of their own, so they run eagerly, in the root's forward
# hooks. Under `torch.compile(model)` a hook is its own top frame, wrapped with `eager_top_frame`:
# Dynamo runs it eagerly (no graph break, also with fullgraph=True), and it calls nothing traceable,
# only the fully disabled functions below (see [Note: nothing traceable in the eager wrapper] in
# passes/install.py). When the model is called from a larger compiled function, Dynamo traces through
# the hooks: they cost a graph break only while sums are pending (an error under fullgraph=True).
@torch.compiler.disable
def _drop_cleared(state: Accumulation) -> None:
    if state.synchronizing():
        state.drop_cleared()


@torch.compiler.disable
def _reduce_unused(state: Accumulation) -> None:
    if state.synchronizing():
        state.reduce_all()


def _before_forward(module: nn.Module, args: tuple) -> None:
    """Root forward pre-hook: before the synchronizing forward takes the sums, drop the cleared ones."""
    state = getattr(module, _STATE_ATTR)
    if not torch.compiler.is_compiling() or state.synchronizing():
        _drop_cleared(state)


def _after_forward(module: nn.Module, args: tuple, output: object) -> None:
    """Root forward hook: the sums the synchronizing forward left (parameters it did not use) are reduced now."""
    state = getattr(module, _STATE_ATTR)
    if not torch.compiler.is_compiling() or state.synchronizing():
        _reduce_unused(state)


def attach(model: nn.Module, state: Accumulation) -> None:
    """Make `state` the one `no_sync(model)` uses, and give the root `model` the forward hooks of
    [Note: when deferred sums are reduced, and when they are dropped]."""
    setattr(model, _STATE_ATTR, state)
    model.register_forward_pre_hook(eager_top_frame(_before_forward))
    model.register_forward_hook(eager_top_frame(_after_forward))


def _state(model: nn.Module, caller: str) -> Accumulation:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"simplefsdp.{caller}() needs the model simplefsdp.wrap() returned; {user_class(model).__name__} "
            "is not a wrapped root"
        )
    return state


@contextlib.contextmanager
def no_sync(model: nn.Module, *, enabled: bool = True) -> Iterator[None]:
    """Inside the block, backward passes accumulate unsharded gradients without reducing them; the
    first forward after it (with grad enabled) and its backward reduce them together with its own
    (see the module notes).

    `enabled=False` makes the block a no-op, for `with no_sync(model, enabled=not last): ...` loops.
    """
    state = _state(model, "no_sync")
    if not enabled:
        yield
        return
    state.make_sinks()
    state.drop_cleared()
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if not state.deferring:
            state.collect()


def reduce_pending(model: nn.Module) -> None:
    """Reduce every deferred gradient sum of the wrapped root `model` into its parameter's `.grad` now.

    A collective: every rank calls it. Needed only when the last micro-batch ran inside `no_sync`;
    otherwise the synchronizing micro-batch reduces every sum (see the module notes).
    """
    state = _state(model, "reduce_pending")
    if state.deferring:
        raise RuntimeError("simplefsdp.reduce_pending() inside simplefsdp.no_sync(): call it after the block")
    state.drop_cleared()
    state.reduce_all()
