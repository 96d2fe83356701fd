"""Rank functions for tests/train/test_compile_cache.py: `simplefsdp.train.loop.train` on inductor with
a tiny model, its compiles cached in a named directory; each call is a fresh process's compile state
(the pool resets Dynamo between calls), so a second call is a warm restart."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simplefsdp.train.config import TrainConfig
from simplefsdp.train.loop import train

TINY = {"n_layers": 1, "dim": 16, "n_heads": 2, "ffn_dim": 32, "seq_len": 8, "batch_per_rank": 2}


def job(directory: str, cache: str, *, steps: int = 1, resume: bool = False, **settings: Any) -> TrainConfig:
    """The job the tests train: `steps` steps into `directory`, compiles cached in `cache`."""
    return TrainConfig(
        **TINY,
        steps=steps,
        resume=resume,
        backend="inductor",
        compile_cache=cache,
        progress=False,
        plot_every=0,
        sample_tokens=0,
        checkpoint_every=0,
        checkpoint_dir=f"{directory}/ckpt",
        **settings,
    )


def checkpoint_digests(directory: str) -> dict[str, str]:
    """SHA-256 of every shard file of the run's checkpoints (parameters and optimizer state), by name."""
    files = sorted(Path(directory, "ckpt").rglob("*.distcp"))
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def train_job(directory: str, cache: str, **options: Any) -> dict[str, Any]:
    """Train the job; this rank's compile-cache record, the losses and its checkpoint shard digests."""
    outcome = train(job(directory, cache, **options), device=torch.device("cpu"))
    dist.barrier()
    return {
        "cache": outcome.compile_cache,
        "losses": outcome.losses,
        "digests": checkpoint_digests(directory),
        "threads": torch.get_num_threads(),
    }
