"""Rank function for tests/train/test_run_dir.py: `simplefsdp.train.loop.train` in the ranks of a pool
(eager: no compile, a tiny model), a 5-step run and its resumption to step 7."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from simplefsdp.train.config import TrainConfig
from simplefsdp.train.loop import train

TINY = {"n_layers": 1, "dim": 16, "n_heads": 2, "ffn_dim": 32, "seq_len": 8, "batch_per_rank": 2}


def run_and_resume(directory: str, tensorboard: bool) -> list[str]:
    """5 steps into `directory`/ckpt (checkpoint at the end), then resumed to step 7; the run folder's
    listing after the first run."""
    config = TrainConfig(
        **TINY,
        steps=5,
        backend="eager",
        progress=False,
        plot_every=0,
        tensorboard=tensorboard,
        checkpoint_every=0,
        checkpoint_dir=f"{directory}/ckpt",
    )
    train(config, device=torch.device("cpu"))
    dist.barrier()
    listing = sorted(p.name for p in config.run_path.iterdir()) if dist.get_rank() == 0 else []
    train(dataclasses.replace(config, steps=7, resume=True), device=torch.device("cpu"))
    return listing


def run_quantized(directory: str) -> tuple[int, list[float]]:
    """`simplefsdp train --steps 2 --backend aot_eager --gather-dtype int8` (bf16 / fp32 policy; the
    gathers quantize in compiled steps only) into `directory`/ckpt: how many slots this rank quantized
    for its all-gathers, and the losses."""
    from simplefsdp.kernels import quantize

    calls = 0
    original = quantize.quantize_slot

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    config = TrainConfig(
        **TINY,
        steps=2,
        backend="aot_eager",
        progress=False,
        plot_every=0,
        checkpoint_every=0,
        checkpoint_dir=f"{directory}/ckpt",
        sample_tokens=0,
        param_dtype="bf16",
        reduce_dtype="fp32",
        gather_dtype="int8",
    )
    quantize.quantize_slot = counted  # the copy-in op's CPU implementation calls it through the module
    try:
        outcome = train(config, device=torch.device("cpu"))
    finally:
        quantize.quantize_slot = original
    return calls, list(outcome.losses)
