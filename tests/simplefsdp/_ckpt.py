"""A small resumable training job, shared by the checkpoint tests and the torchrun fault worker.

`train(root, ...)` trains the reference transformer for `steps` AdamW steps, resuming from the
newest complete checkpoint under `root` if there is one and saving after every step. Each step
draws from every generator a resumed job must restore: Python's `random` picks how far the data
position advances, torch's CPU generator masks 10% of the input tokens. So a resume that loses the
data position or an RNG state trains on different batches and ends with different weights.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import simplefsdp
from simplefsdp import checkpoint
from simplefsdp.models import Transformer, tensor_parallel_plan
from tests.simplefsdp import _training as training

DATASET = torch.randint(0, training.ARGS.vocab_size, (48, training.SEQ + 1), generator=torch.Generator().manual_seed(7))
BATCH = 4  # sequences per global batch


@dataclasses.dataclass(frozen=True)
class Run:
    params: dict[str, torch.Tensor]  # full parameters after the last step
    optim: dict[str, torch.Tensor]  # full optimizer state tensors, "<fqn>.<name>"
    losses: list[float]  # this rank's loss of each step this process ran
    start_step: int  # the step it resumed from (0: fresh)
    data_offset: int


def mesh(strategy: str, shape: tuple[int, ...] | None = None) -> DeviceMesh:
    """`shape` or the default: 1-D over the world, or (2, world / 2) for HYBRID_*."""
    world = dist.get_world_size()
    if shape is None:
        shape = (2, world // 2) if strategy.startswith("HYBRID") else (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def build(
    strategy: str, shape: tuple[int, ...] | None = None, *, tp: int = 1, offload: bool = False
) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model, wrapped (`offload`: with `OffloadPolicy()`); with `tp` > 1 first tensor-parallel on
    a (world / tp, tp) mesh `(dp, tp)`."""
    torch.manual_seed(0)
    random.seed(0)
    model = Transformer(training.ARGS)
    if tp == 1:
        policy = simplefsdp.OffloadPolicy() if offload else None
        simplefsdp.wrap(model, mesh(strategy, shape), strategy=strategy, offload=policy)
    else:
        world = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, world["tp"], tensor_parallel_plan(model))
        simplefsdp.wrap(model, world["dp"], strategy=strategy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": full(value) for p, state in optimizer.state.items() for key, value in state.items()
    }


@dataclasses.dataclass(frozen=True)
class Fault:
    """Rank `rank` sends itself `signum` at step `step`: "mid_step" between the forward and the
    backward (the other ranks then wait in the backward's gradient reduction), or "before_save"
    after the step (they wait in `save_checkpoint`). SIGKILL dies; SIGSTOP hangs with its sockets open."""

    rank: int
    step: int
    signum: int = signal.SIGKILL
    where: str = "mid_step"


def _maybe_fault(fault: Fault | None, k: int, where: str) -> None:
    if fault is not None and (fault.rank, fault.step, fault.where) == (dist.get_rank(), k, where):
        os.kill(os.getpid(), fault.signum)


def step(step_fn, optimizer, offset: int, *, fault: Fault | None = None, k: int = 0) -> tuple[float, int]:
    """Step `k` on the global batch at `offset` (this rank's share); returns (loss, next offset)."""
    rows = [(offset + i) % len(DATASET) for i in range(BATCH)]
    local = DATASET[rows].chunk(dist.get_world_size())[dist.get_rank()]
    masked = local.masked_fill(torch.rand(local.shape) < 0.1, 0)
    loss = training.loss_fn(step_fn, masked)
    _maybe_fault(fault, k, "mid_step")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), offset + BATCH + random.randrange(3)


def train(
    root: str | None,
    *,
    strategy: str,
    steps: int,
    stop_at: int | None = None,
    shape: tuple[int, ...] | None = None,
    backend: str = "eager",
    restore_rng: bool = True,
    fault: Fault | None = None,
    timeout: timedelta = checkpoint.sharded.DEFAULT_TIMEOUT,
    tp: int = 1,
    offload: bool = False,
) -> Run:
    """Train to `steps` (or stop before step `stop_at`), resuming from and saving to `root` (None: no
    checkpoints). `fault`: a rank kills or stops itself (see `Fault`); `timeout`: the checkpoint
    functions' wait for the slowest rank. `tp` > 1 (tensor parallel) is for loading only: `step`
    splits batches over every rank, which is not what the tp ranks of one dp rank must see."""
    model, optimizer = build(strategy, shape, tp=tp, offload=offload)
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    resumed = None
    if root is not None:
        resumed = checkpoint.load_checkpoint(
            root, model=model, optimizer=optimizer, missing_ok=True, restore_rng=restore_rng, timeout=timeout
        )
    start, offset = (resumed.step, resumed.extra["data_offset"]) if resumed else (0, 0)
    if tp > 1 and start < (steps if stop_at is None else stop_at):
        raise ValueError("train(tp > 1) only loads: it must resume at its last step")
    losses = []
    for k in range(start, steps if stop_at is None else stop_at):
        loss, offset = step(step_fn, optimizer, offset, fault=fault, k=k)
        losses.append(loss)
        _maybe_fault(fault, k, "before_save")
        if root is not None:
            extra = {"data_offset": offset}
            checkpoint.save_checkpoint(root, step=k + 1, model=model, optimizer=optimizer, extra=extra, timeout=timeout)
    return Run(
        params={fqn: full(p) for fqn, p in model.named_parameters()},
        optim=full_optimizer_state(model, optimizer),
        losses=losses,
        start_step=start,
        data_offset=offset,
    )


def train_many(jobs: list[tuple[str | None, dict]]) -> list[Run]:
    """`train(root, **kwargs)` for each job in turn, in this pool call (one round trip for many runs)."""
    return [train(root, **kwargs) for root, kwargs in jobs]
