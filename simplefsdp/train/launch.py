"""Start the ranks of `simplefsdp train`: the ones torchrun gave, or spawned ones (`simplefsdp/ranks.py`).

outcome = launch(config)   # rank 0's TrainOutcome
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.distributed as dist

from simplefsdp import checkpoint
from simplefsdp.checkpoint.train_state import read_train_state
from simplefsdp.offload_plan import OffloadPlan
from simplefsdp.ranks import gets_the_result, run_on_ranks, spawn_world, under_torchrun
from simplefsdp.train.config import ConfigError, TrainConfig, check_world
from simplefsdp.train.fit import check_fits
from simplefsdp.train.loop import TrainOutcome, check_fresh_start, check_model, train
from simplefsdp.train.offload_auto import plan_for
from simplefsdp.writable import check_directory, check_file

__all__ = ["LOGGERS", "check_outputs", "launch", "nothing_to_train"]

LOGGERS = ("simplefsdp.train",)  # at INFO on rank 0


def _train_rank(config: TrainConfig, device: torch.device, *, offload_plan: OffloadPlan | None) -> TrainOutcome:
    check_world(config, dist.get_world_size())
    return train(config, device=device, offload_plan=offload_plan)


def check_outputs(config: TrainConfig) -> None:
    """ConfigError unless the run can write where it was told to: the checkpoint directory (every
    rank writes its shards), and on the rank that writes them the export directory (at the end), the
    run folder and the metrics file; with `tensorboard`, that its package is installed. Made before
    any work, so a bad path or a missing package does not cost the training."""
    outputs = [(check_directory, config.checkpoint_dir, "checkpoint_dir")]
    if gets_the_result():
        outputs.append((check_directory, config.export_dir, "export_dir"))
        outputs.append((check_directory, str(config.run_path), "run_dir"))
        outputs.append((check_file, config.metrics_file, "metrics_file"))
        if config.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("tensorboard: the tensorboard package is not installed (pip install tensorboard)")
    try:
        for check, path, name in outputs:
            if path:
                check(path, name=name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def nothing_to_train(config: TrainConfig) -> str | None:
    """With --resume and no --export-dir: why the run has nothing to do when the newest checkpoint
    is at or past `steps` (no rank need start); None otherwise. An unreadable newest checkpoint is
    left to the ranks' loader, which falls back to an older one."""
    newest = checkpoint.latest_checkpoint(config.checkpoint_dir) if config.resume else None
    if newest is None or config.export_dir:
        return None
    try:
        step = int(read_train_state(newest)["step"])
    except checkpoint.CheckpointError:
        return None
    if step < config.steps:
        return None
    return f"nothing to train: the newest checkpoint ({newest}) is at step {step}, --steps is {config.steps}"


def launch(config: TrainConfig) -> TrainOutcome | None:
    """Train on the torchrun ranks or on spawned ones; rank 0's outcome (None on the other torchrun ranks)."""
    device_type = config.device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: no CUDA device is available")
    check_outputs(config)
    plan = None
    if not under_torchrun():  # fail before spawning; the ranks check again (under torchrun too)
        world = spawn_world(config.nproc, device_type)
        check_world(config, world)
        check_fresh_start(config)
        check_model(config)
        check_fits(config, world_size=world, device_type=device_type, ranks_here=world)
        if config.offload == "auto":
            plan = plan_for(config, world_size=world, device_type=device_type)
    elif config.offload != "auto":  # each torchrun rank checks its machine before building
        world = int(os.environ["WORLD_SIZE"])
        check_world(config, world)
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_fits(config, world_size=world, device_type=device_type, ranks_here=here)
    else:
        raise ConfigError(
            "offload auto plans before the ranks start, which torchrun does not leave room for: run without "
            "torchrun, or choose a tier (--offload optimizer or all)"
        )
    return run_on_ranks(
        functools.partial(_train_rank, config, offload_plan=plan),
        nproc=config.nproc,
        device_type=device_type,
        passthrough=(ConfigError,),
        loggers=LOGGERS,
        verbose=config.verbose,
    )
