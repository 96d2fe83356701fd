"""Offload to host memory: what lives there (`OffloadPolicy`) and how a shard reaches the device.

    model = simplefsdp.wrap(model, mesh, offload=simplefsdp.OffloadPolicy())

Offloaded, each sharded master lives in host memory (pinned when the mesh is on CUDA) and its
gradient lands there: the optimizer built on `model.parameters()` then creates its state on the
host and steps there (torch's CPU kernels). Under `OffloadPolicy()` the next forward copies the
updated shard to the device, and device memory holds no parameter, gradient or optimizer state
between steps, only what a step gathers and computes ([Note: two tiers] for the other tier).

In a step, each gather of an offloaded parameter reads its shard through a copy:

    forward:  host shard -> copy_start / copy_wait (to the device) -> [cast] -> all-gather -> compute
    backward: reduce-scatter -> [cast to the master dtype] -> copy_start / copy_wait (to the host)

(`kernels/host_copy.py`: an async pair the reorder pass places like a collective's launch and
wait, [Note: where offload copies sit] in `passes/host_copies.py`). Under FULL_SHARD the backward's
re-gather copies the shard again: the copy sits inside the checkpointed gather, so the step saves
no device copy of an offloaded shard for backward. No kernel reads host memory: compute, casts and
collectives see device tensors only. On a CPU mesh the host is the device and the copies are
identity copies; the graph is the same. The sums `no_sync` defers live with the gradients, in host
memory (`accumulate.py`).

[Note: two tiers]
The optimizer steps the objects `model.parameters()` yields, and creates its state beside them; a
gradient lands on its parameter's device. So the optimizer state lives in host memory exactly when
the masters do, and with them their gradients. What is left to choose is whether the device keeps a
copy of each shard between steps:

- `OffloadPolicy()` ("all", FSDP2's `CPUOffloadPolicy`, Accelerate's `fsdp_offload_params`): it
  keeps nothing; every gather copies its shard in (twice a step under FULL_SHARD: the backward's
  re-gather copies again).
- `OffloadPolicy(parameters=False)` ("optimizer", DeepSpeed's ZeRO-Offload): it keeps each shard in
  the compute dtype (`param_dtype`), which the gathers read, refreshed once per optimizer step
  (`refresh_device_copies`, run after every `optimizer.step()` of an optimizer holding such a
  parameter, and by simplefsdp's loaders and `materialize`). Per parameter and rank the device
  then holds `param_dtype`'s bytes / world instead of master, gradient and optimizer state. A
  master written outside those paths needs `simplefsdp.offload.refresh_device_copies(model)`
  before the next forward (`model.load_state_dict` runs it).

[Note: the device copy's dtype on the way in]
The gather reads the device copy through the master's dtype (an exact widening of `param_dtype`),
so the redistribution that casts it to `param_dtype` again returns its gradient in the master's
dtype: the reduced gradient reaches the host master cast once from `reduce_dtype`, as without
offload, never rounded through `param_dtype`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from simplefsdp.kernels.host_copy import COPY_START, COPY_WAIT
from simplefsdp.settings import TIERS

__all__ = [
    "TIERS",
    "HostShard",
    "OffloadPolicy",
    "attach_device_copy",
    "device_copy_of",
    "host_device_of",
    "move_offloaded_to_host",
    "on_host",
    "refresh_after_load",
    "refresh_device_copies",
    "to_device",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """What lives in host memory: always the optimizer state, the sharded masters it steps (in their
    master dtype, fp32 under mixed precision) and their gradients; see [Note: two tiers].

    Args:
        parameters: also the shards the compute reads: the device keeps nothing between steps.
            False: the device keeps each shard in `param_dtype`, refreshed after each optimizer step.
        pin_memory: pin the host tensors when the mesh is on CUDA (async copies need pinned memory).
    """

    parameters: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"OffloadPolicy.{field.name} must be a bool, got {value!r}")

    @property
    def tier(self) -> str:
        """ "all" or "optimizer" (the names `simplefsdp train --offload` takes)."""
        return "all" if self.parameters else "optimizer"

    @classmethod
    def of_tier(cls, tier: str) -> OffloadPolicy | None:
        """The policy `simplefsdp train --offload TIER` means: None for "none"."""
        if tier not in TIERS:
            raise ValueError(f"offload tier must be one of {', '.join(TIERS)}; got {tier!r}")
        return None if tier == "none" else cls(parameters=tier == "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostShard:
    """How a gather reaches an offloaded shard: on `device` (the mesh's, this rank's) -- copied in
    at each gather, or read from the copy the device keeps (`keep_device_copy`) -- with its gradient
    copied back to the host (pinned if `pin_memory`)."""

    device: torch.device
    pin_memory: bool
    keep_device_copy: bool = False


class _ToDevice(torch.autograd.Function):
    """A host shard's device copy; in backward, the gradient's host copy."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
        ctx.host, ctx.pin_memory = shard.device, pin_memory
        return COPY_WAIT(COPY_START(shard, device), shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _to_host(ctx, grad), None, None


def _to_host(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of an offloaded shard, copied to where the shard lives."""
    return COPY_WAIT(COPY_START(grad, ctx.host, ctx.pin_memory), grad)


class _FromDeviceCopy(torch.autograd.Function):
    """A host shard's value read from the copy the device keeps ([Note: the device copy's dtype on
    the way in]); in backward, the gradient's host copy."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, device_copy: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        ctx.host, ctx.pin_memory = shard.device, pin_memory
        return device_copy.to(shard.dtype, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _to_host(ctx, grad), None, None


def to_device(param: DTensor, where: HostShard, device_copy: torch.Tensor | None = None) -> DTensor:
    """`param` (a DTensor whose local shard is in host memory) with its local shard on the device --
    copied in, or read from `device_copy` -- differentiable: its gradient's local shard is copied
    back to the host."""
    if device_copy is not None:
        local = _FromDeviceCopy.apply(param.to_local(), device_copy, where.pin_memory)
    else:
        local = _ToDevice.apply(param.to_local(), where.device, where.pin_memory)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def host_device_of(mesh_device_type: str) -> torch.device:
    """The device a shard is copied to for a mesh on `mesh_device_type`: this rank's accelerator
    (the one torch made current), or the CPU for a CPU mesh."""
    if mesh_device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh_device_type)
    return torch.device(mesh_device_type, module.current_device())


_DEVICE_COPY_ATTR = "_simplefsdp_device_copy"  # on a parameter: the shard copy the device keeps


def attach_device_copy(param: nn.Parameter, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A device tensor for the copy of `param`'s shard the device keeps ([Note: two tiers]), filled
    from `param` unless it is on the meta device (then `refresh_device_copies` fills it later)."""
    local = param.to_local()
    copy = torch.empty(local.shape, dtype=dtype, device=device)
    setattr(param, _DEVICE_COPY_ATTR, copy)
    _ensure_refresh_hook()
    if not local.is_meta:
        _refresh(param)
    return copy


def device_copy_of(param: torch.Tensor) -> torch.Tensor | None:
    """The copy of `param`'s shard the device keeps, None if it keeps none."""
    return getattr(param, _DEVICE_COPY_ATTR, None)


def _refresh(param: torch.Tensor) -> None:
    copy = getattr(param, _DEVICE_COPY_ATTR, None)
    if copy is not None:
        with torch.no_grad():
            copy.copy_(param.to_local(), non_blocking=True)


def refresh_device_copies(model: nn.Module) -> None:
    """Copy every master of `model` whose device keeps a copy ([Note: two tiers]) to that copy."""
    for param in model.parameters():
        _refresh(param)


def refresh_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """`load_state_dict` post-hook of a wrapped root: the loaded masters reach the device copies."""
    refresh_device_copies(module)


def _refresh_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            _refresh(param)


_HOOKED: list[bool] = []


def _ensure_refresh_hook() -> None:
    """Refresh after every optimizer step, once per process (a global hook: an optimizer built on
    `model.parameters()` is the user's, not ours)."""
    if not _HOOKED:
        register_optimizer_step_post_hook(_refresh_after_step)
        _HOOKED.append(True)


def move_offloaded_to_host(model: nn.Module) -> int:
    """Move the local shard of every offloaded parameter of `model` (wrapped with an offload policy)
    to host memory, keeping each parameter object (optimizers and tied holders keep theirs), and
    fill the device copies the policy keeps; for a model whose shards were just allocated on the
    device (`materialize()`, `--init-from`). Meta shards stay where they are. Returns the bytes moved."""
    from simplefsdp.parametrize import gather_specs_by_parameter

    moved = 0
    for param, spec in gather_specs_by_parameter(model):
        local = param.to_local()
        if spec.host is None or local.is_meta or local.device.type == "cpu":
            continue
        value = on_host(param, pin_memory=spec.host.pin_memory)
        replacement = nn.Parameter(value, requires_grad=param.requires_grad)
        replacement.__dict__.update(param.__dict__)  # swapped below: user tags stay with the object
        torch.utils.swap_tensors(param, replacement)
        moved += local.numel() * local.element_size()
    refresh_device_copies(model)
    return moved


def on_host(value: DTensor, *, pin_memory: bool) -> DTensor:
    """`value` with its local shard in host memory (pinned if asked and CUDA is present); `value`
    itself when the shard is there already or on the meta device."""
    local = value.to_local()
    if local.is_meta or local.device.type == "cpu":
        return value
    host = local.to("cpu")
    if pin_memory and torch.cuda.is_available():
        host = host.pin_memory()
    return DTensor.from_local(
        host, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )
