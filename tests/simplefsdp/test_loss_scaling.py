"""float16 loss scaling (`simplefsdp.grad_scaler`, `simplefsdp/loss_scaling.py`) on 2 gloo ranks, eager.

Underflow: every gradient of the model is below float16's range ([Note: float16 needs loss
scaling]): in float32 all are non-zero, under the float16 policy without a scaler all are zero (and
SGD does not move), with the scaler the unscaled gradients and the parameters after `STEPS` SGD steps
match float32's.
[Note: float16 scaling tolerance] u = 2^-11 is float16's unit roundoff. On its way to the master a
gradient is rounded about eight times in float16 (the gathered weight, the outputs of the two
linears and the tanh, the output gradient's cast, the two matmuls of the backward, the reduction),
so each is compared with float32's within 8u of the largest float32 gradient of that step (the
largest is the scale that matters: near-zero gradients from cancelling sums carry the same absolute
error), and the parameter updates within 8u of the largest update. Seen: at most 2.1u for the
gradients, 1.3u for the updates. A scale that left the gradients subnormal (2^-26 instead of 2^-22
for the loss's factor) gives 15-20u and fails it.

Skip: rank 1 alone finds an inf in its shard of one gradient; every rank must skip that step (no
shard changes) and halve its scale, then take the next, clean step together. On the 1-D mesh, and
on dp 1 x tp 2 with the optimizer's first parameter replicated over tp, where torch's own
`GradScaler` leaves the rank without the inf stepping ([Note: the skip decision is reduced over
every rank]).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import simplefsdp
from tests.simplefsdp import _loss_scaling as job

U = 2.0**-11  # float16's unit roundoff
TOL = 8 * U


def _within(ours: list[torch.Tensor], reference: list[torch.Tensor], what: str) -> None:
    largest = max(float(r.abs().max()) for r in reference)
    worst = max(float((o - r).abs().max()) for o, r in zip(ours, reference, strict=True))
    assert worst <= TOL * largest, f"{what}: off by {worst / largest / U:.1f}u of the largest, bound {TOL / U:.0f}u"


def test_float16_gradients_underflow_without_the_scaler_and_train_like_float32_with_it(ranks2):
    fp32, bare, scaled = (
        ranks2.run(job.underflow, dtype, scaled=flag)[0]
        for dtype, flag in ((torch.float32, False), (torch.float16, False), (torch.float16, True))
    )
    count = sum(g.numel() for g in fp32["grads"][0])
    assert all(int((g != 0).sum()) == g.numel() for step in fp32["grads"] for g in step), "float32: all non-zero"
    assert sum(int((g != 0).sum()) for step in bare["grads"] for g in step) == 0, f"float16: 0 of {count} non-zero"
    assert all(torch.equal(a, b) for a, b in zip(bare["after"], bare["before"], strict=True)), "SGD moved on zeros"
    for step, (ours, reference) in enumerate(zip(scaled["grads"], fp32["grads"], strict=True)):
        _within(ours, reference, f"step {step}'s unscaled gradients")
    updates = [[a - b for a, b in zip(run["after"], run["before"], strict=True)] for run in (scaled, fp32)]
    _within(*updates, "the parameter updates")


@pytest.mark.parametrize("mesh", ["1d", "dp1xtp2"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks2, mesh):
    results = ranks2.run(job.inf_on_one_rank, mesh)
    for rank, result in enumerate(results):
        assert result["changed"] == [False, True], f"rank {rank}: shards changed in steps {result['changed']}"
        assert result["scales"] == [2.0**15, 2.0**15], f"rank {rank}: scales {result['scales']}"


def test_no_scaler_unless_float16(fake_world8):
    for policy, expected in [
        (None, False),
        (simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16), False),
        (simplefsdp.MixedPrecisionPolicy(param_dtype=torch.float16), True),
        (simplefsdp.MixedPrecisionPolicy(reduce_dtype=torch.float16), True),
    ]:
        model = simplefsdp.wrap(nn.Linear(8, 8), mp_policy=policy, passes=None)
        assert simplefsdp.needs_loss_scaling(model) is expected
        scaler = simplefsdp.grad_scaler(model)
        assert (scaler is not None) is expected
        if expected:
            assert isinstance(scaler, torch.amp.GradScaler)
            assert scaler.get_scale() == 2.0**16
    with pytest.raises(ValueError, match=r"Linear is not wrapped by simplefsdp\.wrap\(\)"):
        simplefsdp.grad_scaler(nn.Linear(8, 8))


@pytest.mark.parametrize(("precision", "scaled"), [("fp16", True), ("bf16", False), ("no", False)])
def test_accelerate_settings_give_the_scaler_fp16_needs(fake_world8, precision, scaled):
    settings = simplefsdp.from_accelerate({"distributed_type": "FSDP", "mixed_precision": precision, "fsdp_config": {}})
    assert settings.loss_scaling is scaled
    assert any("settings.grad_scaler(model)" in note for note in settings.notes) is scaled
    model = simplefsdp.wrap(nn.Linear(8, 8), **settings.wrap_kwargs())
    scaler = settings.grad_scaler(model)
    assert isinstance(scaler, torch.amp.GradScaler) if scaled else scaler is None
    if scaled:
        with pytest.raises(ValueError, match=r"mixed_precision: fp16, but the model gathers and reduces in no float16"):
            settings.grad_scaler(simplefsdp.wrap(nn.Linear(8, 8), passes=None))
