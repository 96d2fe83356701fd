"""Start the ranks of `simplefsdp train`: the ones torchrun gave, or spawned ones (`simplefsdp/ranks.py`).

outcome = launch(config)   # rank 0's TrainOutcome
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from simplefsdp.ranks import run_on_ranks, spawn_world, under_torchrun
from simplefsdp.train.config import ConfigError, TrainConfig, check_world
from simplefsdp.train.loop import TrainOutcome, check_fresh_start, check_model, train

__all__ = ["launch"]


def _train_rank(config: TrainConfig, device: torch.device) -> TrainOutcome:
    check_world(config, dist.get_world_size())
    return train(config, device=device)


def launch(config: TrainConfig) -> TrainOutcome | None:
    """Train on the torchrun ranks or on spawned ones; rank 0's outcome (None on the other torchrun ranks)."""
    device_type = config.device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: no CUDA device is available")
    if not under_torchrun():  # fail before spawning; the ranks check again (under torchrun too)
        check_world(config, spawn_world(config.nproc, device_type))
        check_fresh_start(config)
        check_model(config)
    return run_on_ranks(
        functools.partial(_train_rank, config),
        nproc=config.nproc,
        device_type=device_type,
        passthrough=(ConfigError,),
        loggers=("simplefsdp.train",),
        verbose=config.verbose,
    )
