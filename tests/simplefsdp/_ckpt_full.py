"""Rank functions for the full-state export / import tests (run on a gloo rank pool)."""

from __future__ import annotations

import dataclasses

import torch

import simplefsdp
from simplefsdp import checkpoint
from simplefsdp.models import Transformer
from tests.simplefsdp import _ckpt as ckpt
from tests.simplefsdp import _training as training

TIED = dataclasses.replace(training.ARGS, tie_embeddings=True)


def export(directory: str, *, strategy: str, max_shard_bytes: int, tied: bool = False, steps: int = 1):
    """Wrap, train `steps` steps, export; return the full parameters every rank sees."""
    torch.manual_seed(0)
    model = Transformer(TIED if tied else training.ARGS)
    simplefsdp.wrap(model, ckpt.mesh(strategy), strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offset = 0
    for _ in range(steps):
        _, offset = ckpt.step(model, optimizer, offset)
    checkpoint.export_full_state_dict(model, directory, max_shard_bytes=max_shard_bytes)
    return {fqn: ckpt.full(value) for fqn, value in model.state_dict().items()}


def import_(path: str, *, strategy: str, tied: bool = False) -> dict[str, torch.Tensor] | str:
    """Build on meta, wrap, materialize from another seed, import; the full state afterwards, or
    the error's type and message if the import raised."""
    with torch.device("meta"):
        model = Transformer(TIED if tied else training.ARGS)
    simplefsdp.wrap(model, ckpt.mesh(strategy), strategy=strategy)
    torch.manual_seed(99)
    simplefsdp.materialize(model)
    try:
        checkpoint.import_full_state_dict(model, path)
    except checkpoint.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return {fqn: ckpt.full(value) for fqn, value in model.state_dict().items()}
