"""`simplefsdp train --param-dtype fp16`: the loop scales the loss (`simplefsdp.grad_scaler`), says so in
each step's metrics record, and keeps the scaler's state in its checkpoints, so a resumed run goes on
with the scale and growth count the uninterrupted run had (eager, 2 ranks of the pool, a tiny model).
What the scaler itself does (underflow, a skipped step) is tests/simplefsdp/test_loss_scaling.py's.
"""

from __future__ import annotations

import pytest

from tests.train import _fp16_ranks

# slow: tests/_tiers.py (a training run; the scaler itself is tests/simplefsdp/test_loss_scaling.py's, fast)
pytestmark = pytest.mark.slow


def test_fp16_training_scales_the_loss_and_resumes_with_the_same_scaler_state(ranks2, tmp_path):
    result = ranks2.run(_fp16_ranks.run_and_resume, str(tmp_path))[0]
    whole, resumed = result["whole"], result["resumed"]
    assert [r["step"] for r in whole["records"]] == [1, 2, 3, 4]
    scales = [r["loss_scale"] for r in whole["records"]]
    assert scales[0] == 2.0**16
    # the scale halves after a skipped step and stays otherwise (growth comes after 2000 good steps)
    for before, after, record in zip(scales, scales[1:], whole["records"], strict=False):
        assert after == (before / 2 if record["skipped"] else before), whole["records"]
    assert whole["skipped"] == sum(r["skipped"] for r in whole["records"])
    # the gradient norm is measured after unscaling: that of the true gradients (a few units for this
    # model), not of the scaled ones, which the scale multiplies by 2^16
    norms = [r["grad_norm"] for r in whole["records"] if not r["skipped"]]
    assert norms, whole["records"]
    assert all(0 < norm < 100 for norm in norms), norms
    # the resumed run's steps 3-4 are the uninterrupted run's: same scale, same loss, same end state
    assert [r["step"] for r in resumed["records"]] == [3, 4]
    for ours, theirs in zip(resumed["records"], whole["records"][2:], strict=True):
        assert (ours["loss_scale"], ours["skipped"], ours["loss"]) == (
            theirs["loss_scale"],
            theirs["skipped"],
            theirs["loss"],
        ), ours["step"]
    assert resumed["scaler"] == whole["scaler"]
