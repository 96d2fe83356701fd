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
the one reduction, in the reduction dtype, and zeroes the sum (see [Note: the deferred sum meets the gradient in
reduce_dtype] in `gather.py`).

[Note: when deferred sums are reduced, and when they are dropped]
`.grad` behaves as under DDP's `no_sync` (or FSDP2's `set_requires_gradient_sync(False)`), where
the micro-batches' sums wait in `.grad` for the synchronizing backward:
- A sum reaches the gradient exactly once, when a backward consumes it. Every forward of the wrapped
  root outside `no_sync` with grad enabled adds the pending sum of each parameter it uses to that
  parameter's gradient, before the reduction its backward runs anyway; the sum stays pending, and
  the backward that adds it also zeroes it in place (`_AddPending`). So a forward that is never
  backpropagated -- a metric or logging forward, an exception before backward -- loses nothing: the
  next forward adds the sum again. Two forwards backpropagated together (`(loss1 + loss2).backward()`)
  both carry the sum, and whichever backward runs first adds it; the other adds zeros. The sums of
  the parameters such a forward does not use are reduced into their `.grad` right after it, each by
  itself, through the same reduction (`gather.reduce_deferred`). So once a synchronizing backward is
  done, every parameter's `.grad` holds all its micro-batches' reduced gradients, `optimizer.step()`
  can follow, and nothing is carried into the next step. `reduce_pending(model)` reduces every sum
  on demand, for a loop whose last micro-batch ran inside `no_sync`.
- A sum is dropped with its parameter's `.grad`: from the end of the `no_sync` block that left it,
  a parameter with a deferred sum has a `.grad` (zeros if it had none: what is reduced so far), and
  whatever clears or changes that -- `optimizer.zero_grad()`, `model.zero_grad()`, to None or in
  place, `param.grad = None`, or the backward that consumed the sum accumulating into it -- discards
  the sum too (a consumed sum is zeros by then), as it would discard DDP's. Whether `.grad` is still
  the same tensor with the same version counter is checked when a `no_sync` block opens or closes
  and before each forward that would add the sums; a zero_grad inside an open block therefore drops
  only the sums of earlier blocks, and one between a forward and its backward is too late (the sums
  are in the backward graph by then).
- A consumed sum's memory is released at that check, at the next forward or `no_sync` block: until
  then it stays allocated (zeros), as it was during the micro-batches' backwards.

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
    # an offloaded parameter (`offload.py`): where its gathered value and so its sink live, and the
    # host memory its deferred sums are kept in, with its gradients; None: the parameter's device
    compute_device: torch.device | None = None


@dataclasses.dataclass(eq=False)
class Accumulation:
    """One wrapped model's accumulation state, shared by all of its parameters' gather specs.

    Invariant: every sum in `pending` has an entry in `watched` (rebuilt by each `collect`), and is
    valid only while its parameter's `.grad` is the watched tensor at the watched version (see the
    module's notes); entries of sums already reduced are left over and ignored. `used` holds the
    parameters whose sums the current forward added (emptied when a forward begins).
    """

    depth: int = 0  # open no_sync blocks; deferring while > 0
    params: dict[str, _Tracked] = dataclasses.field(default_factory=dict)
    sinks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> zero-stride leaf
    pending: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fqn -> unreduced sum
    watched: dict[str, tuple[weakref.ref, int]] = dataclasses.field(default_factory=dict)  # fqn -> (.grad, version)
    used: set[str] = dataclasses.field(default_factory=set)

    @property
    def deferring(self) -> bool:
        return self.depth > 0

    def synchronizing(self) -> bool:
        """Whether a root forward now is the synchronizing one: outside `no_sync`, grad enabled, sums pending."""
        return not self.deferring and torch.is_grad_enabled() and bool(self.pending)

    def use_pending(self, fqn: str) -> torch.Tensor | None:
        """The deferred gradient sum of parameter `fqn` for a forward to add (None if there is none). It
        stays pending: the backward that adds it zeroes it (see the module's notes)."""
        pending = self.pending.get(fqn)
        if pending is not None:
            self.used.add(fqn)
        return pending

    def add_parameter(
        self,
        fqn: str,
        param: DTensor,
        *,
        grad_dtype: torch.dtype,
        reduce: Callable[[torch.Tensor], None],
        compute_device: torch.device | None = None,
    ) -> None:
        """Track `param`, whose deferred gradient accumulates in `grad_dtype` and is reduced by `reduce`;
        `compute_device`: an offloaded parameter's (its sums then stay in host memory)."""
        self.params[fqn] = _Tracked(param, grad_dtype, reduce, compute_device)

    def make_sinks(self) -> None:
        """A sink per parameter on its current device (built once, so compiled graphs see the same
        leaves; rebuilt only if the parameter moved, e.g. from meta by `materialize`): a leaf of
        the full shape in the gradient dtype, one element of storage."""
        for fqn, tracked in self.params.items():
            param = tracked.param
            device = tracked.compute_device or param.to_local().device
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
                if self.params[fqn].compute_device is not None:  # offloaded: with the gradients, on the host
                    grad = grad.to("cpu")
                self.pending[fqn] = self.pending[fqn] + grad if fqn in self.pending else grad
        self.watched = {}
        for fqn in self.pending:
            param = self.params[fqn].param
            if param.grad is None:
                with torch.no_grad():
                    param.grad = torch.zeros_like(param)
            self.watched[fqn] = (weakref.ref(param.grad), version_counter(param.grad))

    def reduce_all(self, *, except_used: bool = False) -> None:
        """Reduce every pending sum into its parameter's `.grad` (a collective: all ranks at once);
        `except_used`: not those the current forward added."""
        skip = self.used if except_used else set()
        with torch.enable_grad():
            # in the order of `params`: one order on every rank
            for fqn in [fqn for fqn in self.params if fqn in self.pending and fqn not in skip]:
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
    caller gives `full` a dtype at least as wide as `pending`'s, so nothing is rounded here), and
    `pending` is zeroed: a sum several graphs carry is added by the first backward only.

    `pending` is kept on `ctx` rather than saved with `save_for_backward`: the saved-tensor version
    check would refuse the second graph's backward after the first zeroed the shared sum, and that
    zeroing is the point. Compiled, AOTAutograd keeps a forward input's in-place update in the
    backward graph (for an input that does not require grad, as the sum does not).
    """

    @staticmethod
    def forward(ctx, full: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        ctx.pending = pending
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with_sum = grad + ctx.pending.to(grad.device)  # an offloaded parameter's sum comes from the host
        ctx.pending.zero_()
        return with_sum, None


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
        state.used.clear()
        state.drop_cleared()


@torch.compiler.disable
def _reduce_unused(state: Accumulation) -> None:
    if state.synchronizing():
        state.reduce_all(except_used=True)


def _before_forward(module: nn.Module, args: tuple) -> None:
    """Root forward pre-hook: before a synchronizing forward adds the sums, drop the cleared ones."""
    state = getattr(module, _STATE_ATTR)
    if not torch.compiler.is_compiling() or state.synchronizing():
        _drop_cleared(state)


def _after_forward(module: nn.Module, args: tuple, output: object) -> None:
    """Root forward hook: the sums of parameters the synchronizing forward did not use are reduced now."""
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
    next backward of a forward outside it (with grad enabled) reduces them together with its own
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
