"""Rank function for tests/train/test_eval_sample.py: `simplefsdp.train.loop.train` in the ranks of a
pool, with the settings given, returning rank 0's metrics records, the outcome and the graphs
compiled."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from simplefsdp.train.config import TrainConfig
from simplefsdp.train.loop import train

TINY = {"n_layers": 1, "dim": 32, "n_heads": 4, "ffn_dim": 88, "seq_len": 16, "batch_per_rank": 2, "lr": 1e-2}


def run(directory: str, **settings) -> dict:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = TrainConfig(
        **TINY,
        progress=False,
        checkpoint_dir=str(root / "ckpt"),
        metrics_file=str(root / "metrics.jsonl"),
        **settings,
    )
    graphs = counters["stats"]["unique_graphs"]
    outcome = train(config, device=torch.device("cpu"))
    dist.barrier()
    lines = (root / "metrics.jsonl").read_text().splitlines() if dist.get_rank() == 0 else []
    records = [json.loads(line) for line in lines]
    return {
        "records": [r for r in records if "step" in r],
        "summary": next((r["summary"] for r in records if "summary" in r), None),
        "eval_loss": outcome.eval_loss,
        "sample": outcome.sample,
        "graphs": counters["stats"]["unique_graphs"] - graphs,
    }
