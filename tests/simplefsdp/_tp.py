"""Rank functions for the tensor-parallel tests: the reference transformer, TP-parallelized, then wrapped.

Every run trains the same model from the same seed on the same batches for `training.STEPS` SGD steps
(linear in the gradients, so summation-order ulps are not magnified), clipping the gradient norm
to `MAX_NORM` at every step, and returns `(losses, gradient norms before clipping, full
parameters)`. Data parallel splits each global batch over the dp ranks; the tp ranks of one dp
rank see the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import simplefsdp
from simplefsdp.models import tensor_parallel_plan
from tests.simplefsdp import _training as training

MAX_NORM = 0.5
LR = 0.5

TrainResult = tuple[list[float], list[float], dict[str, torch.Tensor]]


def _train(model: nn.Module, step_fn: nn.Module, *, dp_rank: int, dp_size: int) -> TrainResult:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for tokens in training.batches():
        loss = training.loss_fn(step_fn, tokens.chunk(dp_size)[dp_rank])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()  # tp ranks of one dp rank hold the same loss
        losses.append(total.item())
    return losses, norms, training.full_params(model)


def train_reference() -> TrainResult:
    model = training.fresh_model()
    return _train(model, model, dp_rank=0, dp_size=1)


def tp_model(shape: tuple[int, ...], names: tuple[str, ...], *, sequence_parallel: bool = True):
    """(model parallelized on mesh["tp"], the world mesh)."""
    world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = training.fresh_model()
    parallelize_module(model, world["tp"], tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
    return model, world


def train_simplefsdp_tp(backend: str, strategy: str, shape: tuple[int, ...], names: tuple[str, ...]) -> TrainResult:
    model, world = tp_model(shape, names)
    dp_names = names[:-1]
    dp_mesh = world[dp_names] if len(dp_names) > 1 else world[dp_names[0]]
    simplefsdp.wrap(model, dp_mesh, strategy=strategy)
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    coordinate = dict(zip(names, world.get_coordinate(), strict=True))
    dp_rank, dp_size = 0, 1
    for name in dp_names:  # row-major rank over the dp dims
        dp_rank, dp_size = dp_rank * world[name].size() + coordinate[name], dp_size * world[name].size()
    return _train(model, step_fn, dp_rank=dp_rank, dp_size=dp_size)
