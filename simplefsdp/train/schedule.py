"""The learning rate of `simplefsdp train` as a pure function of the step.

    for group in opt.param_groups:
        group["lr"] = lr_at(step, lr=3e-3, schedule="cosine", warmup_steps=10, steps=100)

[Note: the schedule is a function of the step]
The loop sets every parameter group's learning rate from the step index before each optimizer step,
instead of keeping a `torch.optim.lr_scheduler` object: a resumed run restores the step from its
checkpoint and so continues the schedule exactly, with no scheduler state to save or to get out of
step with the optimizer. The shapes are torch's, so a run can be compared with a torch script:

- warmup (`warmup_steps` W > 0): step k = 0 .. W - 1 uses `lr * (k + 1) / W` (`LinearLR` with
  `start_factor=1/W`, `total_iters=W - 1`): the first step is not wasted at lr 0, the last reaches lr;
- then `constant`: lr; `cosine`: `floor + (lr - floor) * (1 + cos(pi * (k - W) / (steps - W))) / 2`
  with `floor = COSINE_FLOOR * lr` (`CosineAnnealingLR` with `T_max=steps - W`,
  `eta_min=floor`): it starts at lr right after the warmup and would reach the floor at step
  `steps`, one past the last.

The cosine decays over `steps`: resuming with a larger `--steps` bends the curve from the resumed
step on (the learning rate at that step changes), as any schedule tied to the run's length does.
"""

from __future__ import annotations

import math

__all__ = ["COSINE_FLOOR", "SCHEDULES", "lr_at"]

SCHEDULES = ("constant", "cosine")
COSINE_FLOOR = 0.1  # the cosine's end, a fraction of the peak lr: common in LLM pretraining recipes


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int, steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based: the step about to be taken) of a run
    of `steps` steps; see [Note: the schedule is a function of the step]."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if not 0 <= warmup_steps <= steps or not 0 <= step < steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= steps ({steps}) and 0 <= step ({step}) < steps")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    floor = COSINE_FLOOR * lr
    return floor + (lr - floor) * (1 + math.cos(math.pi * (step - warmup_steps) / (steps - warmup_steps))) / 2
