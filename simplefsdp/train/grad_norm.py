"""The global gradient L2 norm of a sharded model, and clipping to it (`simplefsdp train --grad-clip`).

    norm = clip_grad_norm(model.parameters(), max_norm=1.0, device=device)   # 0-dim float32 on device
    norm = grad_norm(model.parameters(), device=device)                       # the norm alone

Both equal `torch.nn.utils.clip_grad_norm_` on the unsharded model with the same gradients: the norm
is that of every gradient element once, and clipping multiplies every gradient by
`min(1, max_norm / (norm + 1e-6))`, torch's coefficient. Collective: every rank of the parameters'
meshes calls it with the same parameters in the same order.

[Note: a global norm without gathering]
A gradient DTensor holds on each rank a piece of the whole; along a mesh dim where it is `Shard`
(FSDP's data-parallel dim, a tensor-parallel `Shard`, a strided shard) the pieces are disjoint, and
along one where it is `Replicate` (HYBRID's replicate dim, NO_SHARD, a tensor-parallel replicated
norm weight) they are copies. So the square of the norm is the sum of the local squares, summed over
the shard dims and not over the replicate dims (a copy counts once). The local squares of all
gradients with the same shard dims are added on this rank first, then all-reduced once per shard dim
-- a handful of one-element all-reduces a step, where `full_tensor()` of each gradient's norm (or
torch's `clip_grad_norm_` on DTensors, whose norm is a DTensor to `full_tensor()` once more) costs
one per parameter. Each local square is moved to `device` before the reduction: an offloaded
gradient lives in host memory, and on CUDA the process group may be NCCL alone, which reduces device
tensors only. A `Partial` gradient (unreduced sums) has no norm from its pieces: ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm", "grad_norm"]

_EPS = 1e-6  # torch's clip_grad_norm_ adds it to the norm before dividing


def _shard_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups over which `grad`'s pieces are disjoint ([Note: a global norm without gathering])."""
    if not isinstance(grad, DTensor):
        return ()  # a plain tensor: the same on every rank, or a single process
    groups = []
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient with placements {grad.placements} holds unreduced sums: it has no norm")
        if placement.is_shard():
            groups.append(grad.device_mesh.get_group(dim))
    return tuple(groups)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def grad_norm(parameters: Iterable[nn.Parameter], *, device: torch.device) -> torch.Tensor:
    """The L2 norm of all the gradients of `parameters` (None: none), as a 0-dim float32 tensor on `device`."""
    squares: dict[tuple[str, ...], tuple[tuple[dist.ProcessGroup, ...], list[torch.Tensor]]] = {}  # by group names
    for param in parameters:
        if param.grad is None:
            continue
        groups = _shard_groups(param.grad)
        square = torch.linalg.vector_norm(_local(param.grad), dtype=torch.float32).square()
        squares.setdefault(tuple(g.group_name for g in groups), (groups, []))[1].append(square.to(device))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, parts in squares.values():
        summed = torch.stack(parts).sum()
        for group in groups:
            dist.all_reduce(summed, group=group)
        total += summed
    return total.sqrt()


def clip_grad_norm(parameters: Iterable[nn.Parameter], *, max_norm: float, device: torch.device) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their global norm is at most `max_norm`;
    returns the norm before clipping (see `grad_norm`)."""
    parameters = list(parameters)
    norm = grad_norm(parameters, device=device)
    coefficient = torch.clamp(max_norm / (norm + _EPS), max=1.0)
    on: dict[torch.device, torch.Tensor] = {}  # the coefficient on each device holding gradients, copied once
    for param in parameters:
        if param.grad is not None:
            local = _local(param.grad)
            if local.device not in on:
                on[local.device] = coefficient.to(local.device)
            local.mul_(on[local.device])
    return norm
