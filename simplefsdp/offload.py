"""Offload to host memory: what lives there (`OffloadPolicy`) and how a shard reaches the device.

    model = simplefsdp.wrap(model, mesh, offload=simplefsdp.OffloadPolicy())

With parameters offloaded, each sharded master lives in host memory (pinned when the mesh is on
CUDA) and its gradient lands there: the optimizer built on `model.parameters()` then creates its
state on the host and steps there (torch's CPU kernels), and the next forward copies the updated
shard to the device. Device memory then holds no parameter, gradient or optimizer state between
steps, only what a step gathers and computes.

In a step, each gather of an offloaded parameter reads its shard through a copy:

    forward:  host shard -> copy_start / copy_wait (to the device) -> [cast] -> all-gather -> compute
    backward: reduce-scatter -> [cast to the master dtype] -> copy_start / copy_wait (to the host)

(`kernels/host_copy.py`: an async pair the reorder pass places like a collective's launch and
wait, [Note: where offload copies sit] in `passes/reorder.py`). Under FULL_SHARD the backward's
re-gather copies the shard again: the copy sits inside the checkpointed gather, so the step saves
no device copy of an offloaded shard for backward. No kernel reads host memory: compute, casts and
collectives see device tensors only. On a CPU mesh the host is the device and the copies are
identity copies; the graph is the same.

[Note: which combinations work]
The tiers nest: `parameters` needs `gradients` (a gradient is reduced on the device and its
parameter steps where it lives), and `gradients` needs `optimizer_state` (the step reads gradient
and state together, on the host). What this version moves is everything (`OffloadPolicy()`, what
FSDP2's `CPUOffloadPolicy` and Accelerate's `fsdp_offload_params` mean) or nothing (`offload=None`);
a policy that keeps parameters on the device while state or gradients go to the host is refused by
`wrap()`, named.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.kernels.host_copy import COPY_START, COPY_WAIT

__all__ = ["HostShard", "OffloadPolicy", "host_device_of", "move_offloaded_to_host", "on_host", "to_device"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """What lives in host memory (see [Note: which combinations work]).

    Args:
        parameters: the sharded masters (in their master dtype, fp32 under mixed precision).
        gradients: their reduced gradient shards.
        optimizer_state: the optimizer's state; the optimizer steps on the host.
        pin_memory: pin the host tensors when the mesh is on CUDA (async copies need pinned memory).
    """

    parameters: bool = True
    gradients: bool = True
    optimizer_state: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"OffloadPolicy.{field.name} must be a bool, got {value!r}")
        if self.parameters and not self.gradients:
            raise ValueError(
                "OffloadPolicy(parameters=True, gradients=False) cannot work: a parameter in host memory "
                "steps there, so its gradient has to land there too"
            )
        if self.gradients and not self.optimizer_state:
            raise ValueError(
                "OffloadPolicy(gradients=True, optimizer_state=False) cannot work: the step reads the "
                "gradient and the optimizer state together, so they live in one place"
            )

    @property
    def offloads_anything(self) -> bool:
        return self.optimizer_state

    def check_supported(self) -> None:
        """Raise `ValueError` for a valid combination this version does not move (parameters on the
        device while state or gradients go to the host)."""
        if self.optimizer_state and not self.parameters:
            kept = "gradients and parameters" if not self.gradients else "parameters"
            raise ValueError(
                f"{self} keeps the {kept} on the device while offloading the rest: not available in "
                "this version; offload everything (OffloadPolicy()) or nothing (offload=None)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostShard:
    """How a gather reaches an offloaded shard: copied to `device` (the mesh's, this rank's), its
    gradient copied back to the host (pinned if `pin_memory`)."""

    device: torch.device
    pin_memory: bool


class _ToDevice(torch.autograd.Function):
    """A host shard's device copy; in backward, the gradient's host copy."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
        ctx.host, ctx.pin_memory = shard.device, pin_memory
        return COPY_WAIT(COPY_START(shard, device), shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return COPY_WAIT(COPY_START(grad, ctx.host, ctx.pin_memory), grad), None, None


def to_device(param: DTensor, where: HostShard) -> DTensor:
    """`param` (a DTensor whose local shard is in host memory) with its local shard copied to the
    device, differentiable: its gradient's local shard is copied back to the host."""
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


def move_offloaded_to_host(model: nn.Module) -> int:
    """Move the local shard of every offloaded parameter of `model` (wrapped with an offload policy)
    to host memory, keeping each parameter object (optimizers and tied holders keep theirs); meta
    shards stay where they are (`materialize()` calls this again). Returns the bytes moved."""
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
