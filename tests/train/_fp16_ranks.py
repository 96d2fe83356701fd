"""Rank functions for tests/train/test_fp16.py: `simplefsdp.train.loop.train` in the ranks of a pool
(eager: no compile), with float16 gathers, so the loop scales the loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from simplefsdp.checkpoint.train_state import read_train_state
from simplefsdp.loss_scaling import CHECKPOINT_KEY
from simplefsdp.train.config import TrainConfig
from simplefsdp.train.loop import train

TINY = {"n_layers": 2, "dim": 32, "n_heads": 4, "ffn_dim": 88, "seq_len": 16, "batch_per_rank": 2, "lr": 1e-2}


def _run(root: Path, name: str, **settings) -> dict:
    """Train; returns the metrics records (rank 0 writes them; [] on the others) and the newest
    checkpoint's loss-scaler state."""
    root.mkdir(parents=True, exist_ok=True)
    config = TrainConfig(
        **TINY,
        param_dtype="fp16",
        backend="eager",
        progress=False,
        checkpoint_every=2,
        keep_last=3,
        checkpoint_dir=str(root / "ckpt"),
        metrics_file=str(root / f"{name}.jsonl"),
        **settings,
    )
    outcome = train(config, device=torch.device("cpu"))
    dist.barrier()
    newest = root / "ckpt" / f"step_{config.steps:09d}"
    metrics = root / f"{name}.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if dist.get_rank() == 0 else []
    return {
        "records": [r for r in records if "step" in r],
        "scaler": read_train_state(newest)["extra"].get(CHECKPOINT_KEY),
        "skipped": outcome.skipped_steps,
    }


def run_and_resume(directory: str) -> dict:
    """4 steps (checkpoints at 2 and 4); then, from a copy holding the step-2 checkpoint alone, a resumed
    run to step 4."""
    first = Path(directory) / "first"
    resumed = Path(directory) / "resumed"
    whole = _run(first, "metrics", steps=4)
    if dist.get_rank() == 0:
        shutil.copytree(first / "ckpt" / "step_000000002", resumed / "ckpt" / "step_000000002")
    dist.barrier()
    again = _run(resumed, "metrics", steps=4, resume=True)
    return {"whole": whole, "resumed": again}
