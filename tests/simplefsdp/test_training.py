"""Training parity: simplefsdp vs a single-process model and vs FSDP2 / DDP, every strategy and backend.

2 gloo ranks (4 as a 2x2 mesh for HYBRID_*), 5 AdamW steps on a transformer whose vocabulary (67)
shards unevenly. Tolerances, and where results are bitwise equal:
- vs the single-process reference: not bitwise, since each rank reduces over half the batch and the
  halves are then summed, a different summation order. In fp32 this moves gradients by a few
  ulps; AdamW carries that into the parameters. Measured after 5 steps: <= 4e-7 (eager / aot_eager)
  and <= 1.7e-6 (inductor, which also fuses and reorders). Bound: 64 fp32 ulps relative, and an
  absolute 64 ulps of 1.0 for values near zero.
- vs FSDP2 (DDP for NO_SHARD): bitwise equal in fp32 eager and aot_eager on a 1-D mesh (same ops,
  same collectives, same order); HYBRID_* averages in a different order than FSDP2 (our reduce-scatter
  and all-reduce each average, FSDP2 divides once) and inductor fuses differently, so those use the
  bound above.
- mixed precision (bf16 compute, fp32 reduction): the reference is fp32, so each loss differs by
  bf16 rounding of weights and activations. Bound: 8 bf16 ulps (8 * 2**-7 relative) of the loss.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.simplefsdp import _training as training

FP32_TOL = {"rtol": 64 * torch.finfo(torch.float32).eps, "atol": 64 * torch.finfo(torch.float32).eps}
BF16_LOSS_TOL = {"rtol": 8 * torch.finfo(torch.bfloat16).eps, "atol": 0.0}

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
BACKENDS = ["eager", "aot_eager", "inductor"]


@functools.cache
def _reference() -> training.Result:
    return training.train_reference()


_fsdp2_results: dict[str, training.Result] = {}


def _pool(request, strategy: str):
    return request.getfixturevalue("ranks4" if strategy.startswith("HYBRID") else "ranks2")


def _assert_results_close(actual: training.Result, expected: training.Result, tol: dict | None) -> None:
    if tol is None:  # bitwise
        assert actual.losses == expected.losses
        for fqn, value in expected.params.items():
            assert torch.equal(actual.params[fqn], value), f"{fqn} differs"
        return
    torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses), **tol)
    for fqn, value in expected.params.items():
        torch.testing.assert_close(actual.params[fqn], value, **tol, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_matches_reference_and_fsdp2(request, strategy, backend):
    pool = _pool(request, strategy)
    results = pool.run(training.train_simplefsdp, strategy, backend)
    for rank_result in results[1:]:  # every rank saw the same global losses and full parameters
        _assert_results_close(rank_result, results[0], tol=None)
    ours = results[0]
    assert ours.losses[-1] < ours.losses[0], "training should make progress"

    _assert_results_close(ours, _reference(), FP32_TOL)

    if strategy not in _fsdp2_results:
        _fsdp2_results[strategy] = pool.run(training.train_fsdp2, strategy)[0]
    bitwise = backend != "inductor" and not strategy.startswith("HYBRID")
    _assert_results_close(ours, _fsdp2_results[strategy], None if bitwise else FP32_TOL)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_mixed_precision_training(ranks2, backend):
    """bf16 all-gather / compute, fp32 reduction: fp32 masters and grads, loss within bf16 rounding."""
    results = ranks2.run(
        training.train_simplefsdp, "FULL_SHARD", backend, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    ours = results[0]
    assert {p.dtype for p in ours.params.values()} == {torch.float32}
    assert ours.grad_dtypes == {torch.float32}
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(_reference().losses), **BF16_LOSS_TOL)


@pytest.mark.parametrize("optimizer", list(training.OPTIMIZERS))
def test_optimizers_step_on_sharded_parameters(ranks2, optimizer):
    ours = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager", optimizer=optimizer)[0]
    _assert_results_close(ours, training.train_reference(optimizer), FP32_TOL)


def test_sum_reduction(ranks2):
    """reduce_op="sum" adds the ranks' gradients: with the loss pre-scaled by 1/world it equals avg."""
    summed = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager", reduce_op="sum")[0]
    _assert_results_close(summed, _reference(), FP32_TOL)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "simplefsdp_aot_eager", "inductor"])
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_and_empty_shards(request, world, backend):
    """dim 0 not divisible by (2 ranks) or smaller than (4 ranks: empty shards) the world, through
    the compiled paths with the passes on, which bucket the padded pieces: gradients equal one
    process's on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x = torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    for grads, merged in request.getfixturevalue(f"ranks{world}").run(training.tiny_bias_grads, backend):
        if backend in ("simplefsdp_aot_eager", "inductor"):
            assert merged > 0, "the pass must have bucketed the uneven pieces"
        for fqn, param in model.named_parameters():
            torch.testing.assert_close(grads[fqn], param.grad, **FP32_TOL)


def test_warm_compile_cache_is_per_rank(ranks4):
    """The second run loads every graph from the on-disk compile cache that all 4 ranks share.

    Regression test for [Note: per-rank AOTAutograd cache keys for DTensor inputs]: without
    rank-aware keys, ranks with a 33-row and a 34-row embedding shard (and different group
    names on the 2-D mesh) loaded each other's graphs and failed or hung.
    """
    first = ranks4.run(training.train_simplefsdp, "HYBRID_SHARD", "inductor")
    second = ranks4.run(training.train_simplefsdp, "HYBRID_SHARD", "inductor")
    for a, b in zip(first, second, strict=True):
        _assert_results_close(b, a, tol=None)


@pytest.mark.parametrize("backend", ["simplefsdp_aot_eager", "inductor"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_passes_do_not_change_training(request, strategy, backend):
    """Bucketing and reordering move the same bytes through the same reductions and reorder only
    independent ops: fp32 training with the passes equals training without them, bitwise."""
    pool = _pool(request, strategy)
    plain = pool.run(training.train_simplefsdp, strategy, backend, passes=None)[0]
    with_passes = pool.run(training.train_simplefsdp, strategy, backend, compile_caches=False)[0]
    assert with_passes.collectives_merged > 0, "the pass must have run and merged something"
    if strategy != "NO_SHARD":
        # NO_SHARD's all-reduces are created at gradient accumulation, outside the traced gather, so
        # they carry no parameter name: the block plan puts them in one bucket, launched after the
        # last gradient and waited right away (the graph's end); nothing to move.
        assert with_passes.collectives_moved > 0, "the pass must have run and moved something"
    _assert_results_close(with_passes, plain, tol=None)
