"""`simplefsdp train`'s learning rate (`--lr-schedule`, `--warmup-steps`) against torch's schedulers,
every step, one process: `lr_at` is what `LinearLR` (warmup) then `ConstantLR` / `CosineAnnealingLR`
(chained by `SequentialLR`) give an optimizer stepped once per step.

Tolerance: 1e-12 relative. `CosineAnnealingLR` updates its value recursively from the previous
step's, `lr_at` evaluates the closed form; the two part by an ulp or so per step (seen: 1.5e-14 after
1000 steps). A shape off by a step or a factor is off by far more.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

from simplefsdp.train.schedule import COSINE_FLOOR, lr_at

LR = 3e-3


def _torch_lrs(schedule: str, warmup: int, steps: int) -> list[float]:
    """The learning rate torch's schedulers give each of `steps` optimizer steps."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    after = (
        CosineAnnealingLR(opt, T_max=steps - warmup, eta_min=COSINE_FLOOR * LR)
        if schedule == "cosine" and steps > warmup
        else ConstantLR(opt, factor=1.0, total_iters=0)
    )
    if warmup == 0:
        scheduler = after
    else:  # one warmup step is lr itself: LinearLR needs total_iters >= 1
        first = LinearLR(opt, 1 / warmup, 1.0, warmup - 1) if warmup > 1 else ConstantLR(opt, 1.0, total_iters=0)
        scheduler = SequentialLR(opt, [first, after], milestones=[warmup])
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        with warnings.catch_warnings():  # SequentialLR's deprecation note about its epoch argument
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    return lrs


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize(("warmup", "steps"), [(0, 40), (1, 40), (7, 40), (40, 40), (3, 4), (0, 1), (1, 1), (0, 1000)])
def test_lr_matches_torch_schedulers_every_step(schedule, warmup, steps):
    ours = [lr_at(step, lr=LR, schedule=schedule, warmup_steps=warmup, steps=steps) for step in range(steps)]
    theirs = _torch_lrs(schedule, warmup, steps)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0.0)
    if warmup:
        assert ours[warmup - 1] == pytest.approx(LR, rel=1e-15), "the warmup's last step reaches lr"
        assert ours[0] == pytest.approx(LR / warmup, rel=1e-15), "the first step does not run at lr 0"
    if schedule == "cosine" and steps - warmup > 1:
        assert LR > ours[-1] > COSINE_FLOOR * LR


def test_lr_at_refuses_steps_outside_the_run():
    with pytest.raises(ValueError, match="0 <= step"):
        lr_at(5, lr=LR, schedule="cosine", warmup_steps=0, steps=5)
    with pytest.raises(ValueError, match="schedule must be one of constant, cosine"):
        lr_at(0, lr=LR, schedule="linear", warmup_steps=0, steps=5)
