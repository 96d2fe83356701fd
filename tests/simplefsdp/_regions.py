"""Rank function for the regions test: a few compiled steps (`simplefsdp_aot_eager`: AOTAutograd
partitions as inductor does; inductor itself compiles regions in every other compiled test) of the
LoRA model (tied and frozen parameters) with every block checkpointed, the first under `no_sync`,
with or without regions."""

from __future__ import annotations

import torch
import torch.distributed as dist

import simplefsdp
from simplefsdp.regions import has_regions
from tests.simplefsdp import _compose as compose
from tests.simplefsdp import _training as training


def losses_and_grads(compile_regions: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(this rank's losses, the full parameters after the steps)."""
    model = compose.lora_model()
    simplefsdp.checkpoint_blocks(model)
    simplefsdp.wrap(model, compile_regions=compile_regions)
    assert has_regions(model) is compile_regions
    step_fn = torch.compile(model, backend="simplefsdp_aot_eager")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for i, tokens in enumerate(training.batches(3)):
        with simplefsdp.no_sync(model, enabled=i == 0):
            loss = training.loss_fn(step_fn, tokens.chunk(world)[rank])
            loss.backward()
        if i > 0:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, training.full_params(model)
