"""Loss scaling for float16: the gradient scaler a wrapped model needs, or None.

    scaler = simplefsdp.grad_scaler(model)      # None unless the model gathers or reduces in float16
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # before clipping: the norm of the true gradients
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                      # skipped on every rank when a gradient holds an inf/nan
    scaler.update()

`simplefsdp train` does this itself for `--param-dtype fp16` (or `--reduce-dtype fp16`), the
Trainer (`simplefsdp.hf`) for `TrainingArguments(fp16=True)`, and `AccelerateSettings.grad_scaler`
gives the scaler an Accelerate `mixed_precision: fp16` configuration needs.

[Note: float16 needs loss scaling]
float16 keeps 5 exponent bits: nothing smaller than 2^-24 (about 6e-8) survives, where bfloat16 and
float32 go down to 2^-149. Under a policy that gathers in float16 the backward runs in float16, so
activation gradients below that flush to zero, and a float16 reduction rounds the summed gradients
the same way: a model whose gradients are small trains on zeros. torch's remedy is used as it is:
the loss is multiplied by a large factor (the scale, 2^16 to start) before backward, the gradients
are divided by it in their float32 masters before clipping and the optimizer step, and a step whose
gradients hold an inf or nan (the scale was too large) is skipped and the scale halved; after
`growth_interval` good steps in a row it doubles again. bfloat16 has float32's exponent range and
needs none of this.

[Note: the skip decision is reduced over every rank]
Every rank must skip the same steps: a rank that steps while another skips leaves the shards of one
model at different steps and the ranks' scales apart. `torch.amp.GradScaler` checks this rank's
gradient shards for infs and nans; for DTensor gradients torch then reduces the flag over the mesh
dims on which the *first* gradient of the optimizer is not `Replicate`. That covers a 1-D or hybrid
data-parallel mesh, but with tensor parallelism a first gradient replicated over tp (a norm's
weight, first in many models) leaves the flag unreduced over tp: with torch 2.13 on 2 ranks (dp 1 x
tp 2), an inf in one rank's shard of a tp-sharded weight makes that rank skip and halve its scale
while the other steps (`tests/simplefsdp/test_loss_scaling.py` runs this case). torch's
`ShardedGradScaler` (a `GradScaler` subclass from its FSDP, for gradients on any device, the host
included) does the same check and then all-reduces the flag over a process group, so every rank
skips together whatever the mesh, for one one-element all-reduce per step. That is the scaler given
here, over the default process group unless told otherwise: every rank of it must step the model.
Its flag and inverse scale are one-element tensors of shape (1,), which DTensor's dispatch treats
as replicated (what they are) with a `UserWarning` asking for a 0-dim tensor; `unscale_` keeps that
one warning off the terminal, every other warning shows.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from simplefsdp.class_swap import user_class
from simplefsdp.parametrize import gather_specs

__all__ = ["CHECKPOINT_KEY", "grad_scaler", "needs_loss_scaling", "new_grad_scaler"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "grad_scaler"  # a scaler's `state_dict()` in a checkpoint's `extra` (train, the Trainer)

# DTensor's warning about the scaler's (1,)-shaped flag: see the end of the skip-decision note
_ONE_ELEMENT_FLAG = "Found a non-scalar tensor with numel=1 and ndim!=0"


class _GradScaler(ShardedGradScaler):
    """torch's `ShardedGradScaler`; `unscale_` without DTensor's warning about its one-element flag."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ONE_ELEMENT_FLAG, category=UserWarning)
            super().unscale_(optimizer)


def needs_loss_scaling(model: nn.Module) -> bool:
    """Whether the wrapped `model` gathers or reduces any parameter in float16 ([Note: float16 needs
    loss scaling]). `ValueError` for a model `wrap()` did not shard."""
    specs = gather_specs(model)
    if not specs:
        raise ValueError(f"{user_class(model).__name__} is not wrapped by simplefsdp.wrap(): no sharded parameters")
    return any(torch.float16 in (spec.param_dtype, spec.reduce_dtype) for spec in specs)


def new_grad_scaler(
    device_type: str,
    *,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    group: dist.ProcessGroup | None = None,
) -> ShardedGradScaler:
    """A loss scaler for gradients on `device_type` ("cpu", "cuda"), its inf/nan flag reduced over
    `group` (None: the default process group): [Note: the skip decision is reduced over every rank]."""
    if not dist.is_initialized():
        raise ValueError("the grad scaler reduces its inf/nan flag over the ranks: init the process group first")
    if init_scale <= 0 or growth_interval < 1:
        raise ValueError(f"init_scale must be > 0 and growth_interval >= 1; got {init_scale} and {growth_interval}")
    scaler = _GradScaler(
        device_type,
        init_scale=init_scale,
        growth_interval=growth_interval,
        process_group=group if group is not None else dist.group.WORLD,
    )
    logger.info("simplefsdp: float16 loss scaling, initial scale %g (torch's ShardedGradScaler)", init_scale)
    return scaler


def grad_scaler(
    model: nn.Module,
    *,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    group: dist.ProcessGroup | None = None,
) -> ShardedGradScaler | None:
    """The loss scaler the wrapped `model` needs: a `torch.amp.GradScaler` (torch's `ShardedGradScaler`)
    when it gathers or reduces in float16, on its parameters' device; None otherwise. Use it in the
    order of the module docstring: scale, backward, unscale, clip, step, update."""
    if not needs_loss_scaling(model):
        return None
    device_type = next(iter(model.parameters())).device.type
    return new_grad_scaler(device_type, init_scale=init_scale, growth_interval=growth_interval, group=group)
