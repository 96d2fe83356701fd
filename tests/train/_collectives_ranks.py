"""Rank function for tests/train/test_scoreboard_collectives.py: one "step" of known collectives,
counted by bench/_collectives.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _collectives import StepCollectives, count_step_collectives


def count_known_collectives() -> StepCollectives:
    """Three all-gathers of known inputs (bf16 [10], uint8 [6] by torch's functional collective, fp32
    [3] into a list) and one all-reduce of fp32 [4], in one step."""
    world = dist.get_world_size()
    bf16, codes, fp32 = torch.ones(10, dtype=torch.bfloat16), torch.ones(6, dtype=torch.uint8), torch.ones(3)

    def step() -> None:
        dist.all_gather_into_tensor(torch.empty(10 * world, dtype=torch.bfloat16), bf16)
        funcol.wait_tensor(funcol.all_gather_tensor(codes, 0, dist.group.WORLD))
        dist.all_gather([torch.empty(3) for _ in range(world)], fp32)
        dist.all_reduce(torch.ones(4))

    return count_step_collectives(step)
