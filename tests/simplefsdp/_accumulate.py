"""Rank functions for the `no_sync` semantics tests: a schedule of micro-batches, run by simplefsdp on
every rank and by a single process on the whole batch, with the gradients recorded at each check.

The model has a trunk and two heads; each micro-batch says which heads its loss uses, so a head can
be left out of the synchronizing micro-batch. Besides micro-batches, a schedule holds forwards that
are never backpropagated (one of them interrupted by an exception) and two forwards backpropagated
together. Shapes are small and uneven over 2 ranks (the heads'
3-element biases shard 2 + 1), so one schedule runs in well under a second eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import simplefsdp

DIM = 12
GLOBAL_BATCH = 8
HEADS = ("a", "b")


class TwoHeads(nn.Module):
    """`forward(x, heads)`: the loss of the chosen heads on a shared trunk (a scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.heads = nn.ModuleDict({head: nn.Linear(DIM, 3) for head in HEADS})  # repeated blocks: one bucket each

    def forward(self, x: torch.Tensor, heads: tuple[str, ...] = HEADS, *, fail: bool = False) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        loss = sum(self.heads[head](hidden).square().mean() for head in heads)
        if fail:  # every parameter gathered, then the forward is interrupted
            raise ForwardInterruptedError
        return loss


class ForwardInterruptedError(Exception):
    """Raised by `TwoHeads.forward(..., fail=True)`."""


def two_heads() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


def micro_batch(index: int) -> torch.Tensor:
    """The global micro-batch `index` (the same on every rank and in the reference)."""
    return torch.randn(GLOBAL_BATCH, DIM, generator=torch.Generator().manual_seed(100 + index))


@dataclasses.dataclass(frozen=True)
class Backward:
    """One micro-batch's forward and backward, inside `no_sync` unless `sync`."""

    heads: tuple[str, ...]
    sync: bool


@dataclasses.dataclass(frozen=True)
class ForwardOnly:
    """A forward outside `no_sync` with grad enabled that is never backpropagated (a metric or a
    logging forward); `fail`: interrupted by an exception inside the model. Nothing in the reference."""

    heads: tuple[str, ...]
    fail: bool = False


@dataclasses.dataclass(frozen=True)
class BackwardTogether:
    """Two micro-batches' forwards outside `no_sync`, backpropagated together: `(loss1 + loss2).backward()`."""

    heads: tuple[tuple[str, ...], tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class ZeroGrad:
    """`how`: "optimizer" (set_to_none), "optimizer-in-place" (set_to_none=False) or "model"."""

    how: str


@dataclasses.dataclass(frozen=True)
class ReducePending:
    """`simplefsdp.reduce_pending(model)`; nothing in the reference, whose sums are in `.grad` already."""


@dataclasses.dataclass(frozen=True)
class Check:
    """Record every parameter's full gradient (None where it has none)."""


Action = Backward | ForwardOnly | BackwardTogether | ZeroGrad | ReducePending | Check
Grads = dict[str, torch.Tensor | None]


def _zero_grad(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> None:
    if how == "model":
        model.zero_grad()
    else:
        opt.zero_grad(set_to_none=how == "optimizer")


def _grads(model: nn.Module) -> Grads:
    return {
        fqn: None if p.grad is None else (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for fqn, p in model.named_parameters()
    }


def _run(
    model: nn.Module,
    step_fn: Callable[..., torch.Tensor],
    schedule: list[Action],
    *,
    rows: Callable[[torch.Tensor], torch.Tensor],
    defer: Callable[[bool], contextlib.AbstractContextManager[None]],
    reduce_pending: Callable[[], None],
    forward_only: bool,
) -> list[Grads]:
    """Play `schedule`: `rows(x)` is the part of a global micro-batch this process computes on,
    `defer(sync)` the context a micro-batch's forward and backward run in; `forward_only`: whether
    `ForwardOnly` actions run at all."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # only its zero_grad is used
    checks, index = [], 0
    for action in schedule:
        if isinstance(action, Backward):
            with defer(action.sync):
                step_fn(rows(micro_batch(index)), heads=action.heads).backward()
            index += 1
        elif isinstance(action, ForwardOnly):
            if forward_only:
                with contextlib.suppress(ForwardInterruptedError):
                    step_fn(rows(micro_batch(index)), heads=action.heads, fail=action.fail)
            index += 1
        elif isinstance(action, BackwardTogether):
            first, second = (rows(micro_batch(index + i)) for i in range(2))
            (step_fn(first, heads=action.heads[0]) + step_fn(second, heads=action.heads[1])).backward()
            index += 2
        elif isinstance(action, ZeroGrad):
            _zero_grad(model, opt, action.how)
        elif isinstance(action, ReducePending):
            reduce_pending()
        else:
            checks.append(_grads(model))
    return checks


def run_simplefsdp(
    backend: str,
    schedule: list[Action],
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> list[Grads]:
    """FULL_SHARD on every rank, each computing on its share of each micro-batch."""
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = simplefsdp.wrap(two_heads(), mp_policy=policy)
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    return _run(
        model,
        step_fn,
        schedule,
        rows=lambda x: x.chunk(world)[rank],
        defer=lambda sync: simplefsdp.no_sync(model, enabled=not sync),
        reduce_pending=lambda: simplefsdp.reduce_pending(model),
        forward_only=True,
    )


def run_reference(schedule: list[Action]) -> list[Grads]:
    """One process, whole micro-batches; every backward accumulates in `.grad` (DDP's sums)."""
    model = two_heads()
    return _run(
        model,
        model,
        schedule,
        rows=lambda x: x,
        defer=lambda sync: contextlib.nullcontext(),
        reduce_pending=lambda: None,
        forward_only=False,
    )


def emulate_policy(
    micro_batches: int,
    *,
    world: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    round_sums_to: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients the mixed-precision policy defines for `micro_batches` micro-batches (all heads)
    accumulated and then reduced once, computed in one process as the policy states it: each of the
    `world` ranks computes on its share with the parameters cast to `param_dtype` (inputs too, as
    `cast_forward_inputs` does), casts its gradients to `reduce_dtype` and sums them over the
    micro-batches; the ranks' sums are averaged in `reduce_dtype` and cast to the master dtype.

    `round_sums_to` (a negative control) rounds each rank's sum to that dtype before the average.
    """
    model = two_heads()
    sums = [dict.fromkeys(dict(model.named_parameters()), 0) for _ in range(world)]
    for index in range(micro_batches):
        for rank, rows in enumerate(micro_batch(index).chunk(world)):
            params = {fqn: p.detach().to(param_dtype).requires_grad_() for fqn, p in model.named_parameters()}
            torch.func.functional_call(model, params, (rows.to(param_dtype),)).backward()
            for fqn, p in params.items():
                sums[rank][fqn] = sums[rank][fqn] + p.grad.to(reduce_dtype)
    if round_sums_to is not None:
        sums = [{fqn: s.to(round_sums_to).to(reduce_dtype) for fqn, s in rank_sums.items()} for rank_sums in sums]
    return {fqn: (sum(rank_sums[fqn] for rank_sums in sums) / world).to(p.dtype) for fqn, p in model.named_parameters()}
