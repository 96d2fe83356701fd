"""Rank function for tests/train/test_grad_norm.py: the train model of each layout (eager), one
backward on this rank's batch, then `clip_grad_norm` beside torch's `clip_grad_norm_` on the full
(unsharded) gradients."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.train.config import TrainConfig
from simplefsdp.train.data import TokenBatches
from simplefsdp.train.evaluate import lm_loss
from simplefsdp.train.grad_norm import clip_grad_norm
from simplefsdp.train.loop import build_model

TINY = {"n_layers": 1, "dim": 32, "n_heads": 4, "ffn_dim": 88, "seq_len": 16, "batch_per_rank": 2}


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A copy: `full_tensor()` of a gradient whose every dim has size 1 or `Replicate` is its local tensor."""
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()


def clip_layouts(layouts: dict[str, dict], max_norm: float) -> dict[str, dict]:
    """Per layout: our norm, torch's on the full gradients, the placements seen, and per parameter the
    full clipped gradient, ours and torch's."""
    results = {}
    for name, settings in layouts.items():
        config = TrainConfig(**TINY, backend="eager", **settings)
        setup = build_model(config, torch.device("cpu"))
        batches = TokenBatches(
            seq_len=config.seq_len, batch_per_rank=2, dp_rank=setup.dp_rank, dp_size=setup.dp_size, seed=1
        )
        lm_loss(setup.model, next(batches)).backward()
        named = dict(setup.model.named_parameters())
        reference = {fqn: nn.Parameter(torch.zeros_like(_full(p.grad))) for fqn, p in named.items()}
        for fqn, p in named.items():
            reference[fqn].grad = _full(p.grad)
        want = torch.nn.utils.clip_grad_norm_(list(reference.values()), max_norm)
        got = clip_grad_norm(list(named.values()), max_norm=max_norm, device=torch.device("cpu"))
        results[name] = {
            "norm": got,
            "want": want,
            "placements": sorted({str(p.grad.placements) for p in named.values() if isinstance(p.grad, DTensor)}),
            "grads": {fqn: (_full(p.grad), reference[fqn].grad) for fqn, p in named.items()},
        }
    return results
