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
- mixed precision (bf16 compute, fp32 reduction): see [Note: the mixed-precision comparison].
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._tiers import fast_first
from tests.simplefsdp import _training as training

FP32_TOL = {"rtol": 64 * torch.finfo(torch.float32).eps, "atol": 64 * torch.finfo(torch.float32).eps}

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
BACKENDS = ["eager", "aot_eager", "inductor"]
# Inductor compiles for two strategies, the 1-D mesh that re-gathers in backward and the 2-D mesh
# that keeps its gathered weights: its lowering of the collectives and copy ops is the same for the
# others, whose graphs the other backends run.
INDUCTOR_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD_ZERO2")


def _cases(backends: list[str], *, fast: int, skip: tuple[tuple[str, str], ...] = ()) -> list:
    """(strategy, backend) pairs: every strategy under each backend but inductor, which runs
    `INDUCTOR_STRATEGIES`, less `skip`; the first `fast` pairs (the first strategy's) in the fast tier."""
    pairs = [(s, b) for s in STRATEGIES for b in backends if b != "inductor"]
    pairs += [(s, "inductor") for s in INDUCTOR_STRATEGIES if "inductor" in backends]
    return fast_first([pair for pair in pairs if pair not in skip], fast=fast, rows=True)


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


@pytest.mark.parametrize(("strategy", "backend"), _cases(BACKENDS, fast=2))
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


# [Note: the mixed-precision comparison]
# simplefsdp trains with param_dtype=bf16, reduce_dtype=fp32 for 5 SGD steps (updates linear in the
# gradients: AdamW would magnify the rounding of near-zero gradients) and is compared, by its
# parameters, with `train_policy_reference` -- one process doing what the policy says the 2 ranks
# do: compute with the fp32 masters cast to bf16, average the gradients in fp32, step fp32 masters
# -- and with FSDP2 under the same policy. The deviation of one run from another is, per parameter,
# the distance of the two over the distance the reference moved from the initial values (2-norms),
# the largest over the parameters. Bounds:
# - eager: the reference performs each rank's bf16 operations on the same values, and a 2-rank
#   average is one correctly rounded fp32 operation in both, so they can differ by summation order
#   only. Bound: 64 fp32 eps of the movement, as FP32_TOL allows (measured: bitwise equal, to the
#   reference and to FSDP2).
# - inductor: keeps a fused kernel's intermediates in fp32 where eager rounds every op's output to
#   bf16 (2**-8 relative each, several per layer, forward and backward). That perturbs each step's
#   gradients by a few bf16 ulps, and 5 steps carry it into the parameters about as far as
#   computing in fp32 instead of bf16 would. Bound: 8 bf16 eps (2**-4) of the movement (measured:
#   at most 0.029).
# Negative controls: wrong references that the comparison must reject, i.e. that deviate from
# simplefsdp's result by more than the bound (measured, eager: 0.017 for a bf16 reduction, 0.023
# for fp32 compute, 1 without the optimizer step, 2.1 without the reduction). Under inductor a bf16
# reduction or fp32 compute stays within inductor's own rounding (0.032 and 0.023), so only the
# coarse controls apply there; the dtypes of the compiled collectives are checked by
# test_graphs.py::test_mixed_precision_collective_dtypes.
BF16, FP32 = torch.bfloat16, torch.float32
MP_POLICY = {"param_dtype": BF16, "reduce_dtype": FP32}
MP_OPTIMIZER = "sgd-for-loop"
MP_BOUND = {"eager": 64 * torch.finfo(FP32).eps, "inductor": 8 * torch.finfo(BF16).eps}
MP_CONTROLS = {  # name -> (how the reference goes wrong, the backends whose bound must reject it)
    "reduced in bf16": ({**MP_POLICY, "reduce_dtype": BF16}, ("eager",)),
    "computed in fp32": ({**MP_POLICY, "param_dtype": FP32}, ("eager",)),
    "no optimizer step": ({**MP_POLICY, "step": False}, ("eager", "inductor")),
    "no reduction (rank 0's gradient)": ({**MP_POLICY, "reduce": False}, ("eager", "inductor")),
}


@functools.cache
def _policy_reference(**how) -> training.Result:
    return training.train_policy_reference(MP_OPTIMIZER, world=2, **how)


def _deviation(actual: training.Result, expected: training.Result, *, moved: training.Result) -> float:
    """The largest over the parameters of |actual - expected| / |moved - initial| (2-norms)."""
    initial = training.full_params(training.fresh_model())
    return max(
        ((actual.params[fqn] - value).norm() / (moved.params[fqn] - initial[fqn]).norm()).item()
        for fqn, value in expected.params.items()
    )


@pytest.mark.parametrize("backend", fast_first(["eager", "inductor"]))
def test_mixed_precision_training(ranks2, backend):
    """bf16 all-gather / compute, fp32 reduction, fp32 masters: the parameters after 5 steps are the
    policy's, and FSDP2's (see [Note: the mixed-precision comparison])."""
    ours = ranks2.run(training.train_simplefsdp, "FULL_SHARD", backend, optimizer=MP_OPTIMIZER, **MP_POLICY)[0]
    assert {p.dtype for p in ours.params.values()} == {FP32}
    assert ours.grad_dtypes == {FP32}
    want, bound = _policy_reference(**MP_POLICY), MP_BOUND[backend]
    if "mixed" not in _fsdp2_results:
        _fsdp2_results["mixed"] = ranks2.run(training.train_fsdp2, "FULL_SHARD", optimizer=MP_OPTIMIZER, **MP_POLICY)[0]
    for name, other in (("the policy reference", want), ("FSDP2", _fsdp2_results["mixed"])):
        deviation = _deviation(ours, other, moved=want)
        assert deviation <= bound, f"simplefsdp deviates from {name} by {deviation:.3g} > {bound:.3g}"
    for name, (how, rejected_by) in MP_CONTROLS.items():
        if backend in rejected_by:
            deviation = _deviation(ours, _policy_reference(**how), moved=want)
            assert deviation > bound, (
                f"negative control {name!r} passes the comparison ({deviation:.3g} <= {bound:.3g})"
            )


def test_bf16_loaded_model_gets_fp32_masters_under_a_policy(ranks2):
    """A model loaded in bf16 and wrapped under the bf16 policy trains exactly as the same weights
    loaded in fp32 (its masters, gradients and optimizer state are fp32; bitwise, as both gather the
    same bf16 values); without a policy it keeps bf16 masters (pure bf16 training)."""
    bf16 = torch.bfloat16
    loaded_bf16 = ranks2.run(training.train_loaded, bf16)[0]
    loaded_fp32 = ranks2.run(training.train_loaded, FP32)[0]
    assert loaded_bf16.state_dtypes == loaded_fp32.state_dtypes == {FP32}
    assert loaded_bf16.grad_dtypes == {FP32}
    assert loaded_bf16.losses == loaded_fp32.losses
    for fqn, value in loaded_fp32.params.items():
        assert loaded_bf16.params[fqn].dtype == FP32, fqn
        assert torch.equal(loaded_bf16.params[fqn], value), fqn
    pure = ranks2.run(training.train_loaded, bf16, policy=False)[0]
    assert {p.dtype for p in pure.params.values()} == pure.state_dtypes == {bf16}


@pytest.mark.parametrize("optimizer", list(training.OPTIMIZERS))
def test_optimizers_step_on_sharded_parameters(ranks2, optimizer):
    ours = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager", optimizer=optimizer)[0]
    _assert_results_close(ours, training.train_reference(optimizer), FP32_TOL)


def test_sum_reduction(ranks2):
    """reduce_op="sum" adds the ranks' gradients: with the loss pre-scaled by 1/world it equals avg."""
    summed = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager", reduce_op="sum")[0]
    _assert_results_close(summed, _reference(), FP32_TOL)


@pytest.mark.parametrize("backend", fast_first(["simplefsdp_aot_eager", "eager", "inductor"]))
@pytest.mark.parametrize("world", fast_first([2, 4]))
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


@pytest.mark.slow
def test_warm_compile_cache_is_per_rank(ranks4, tmp_path):
    """The second run loads every graph from the on-disk compile cache that all 4 ranks share (a fresh
    one: the first run compiles every graph), and trains bitwise as the first.

    Regression test for [Note: per-rank AOTAutograd cache keys for DTensor inputs]: without
    rank-aware keys, ranks with a 33-row and a 34-row embedding shard (and different group
    names on the 2-D mesh) loaded each other's graphs and failed or hung.
    """
    cold = ranks4.run(training.train_simplefsdp, "HYBRID_SHARD", "inductor", cache_dir=str(tmp_path))
    warm = ranks4.run(training.train_simplefsdp, "HYBRID_SHARD", "inductor", cache_dir=str(tmp_path))
    for rank, (a, b) in enumerate(zip(cold, warm, strict=True)):
        _assert_results_close(b, a, tol=None)
        assert a.compile_cache["autograd_cache_hit"] == 0 < a.compile_cache["autograd_cache_miss"], (rank, a)
        assert b.compile_cache["autograd_cache_miss"] == 0 < b.compile_cache["autograd_cache_hit"], (rank, b)


# HYBRID_SHARD_ZERO2's rewrite runs under inductor only: the aot backend runs the same pass output op by op
@pytest.mark.parametrize(
    ("strategy", "backend"),
    _cases(["simplefsdp_aot_eager", "inductor"], fast=1, skip=(("HYBRID_SHARD_ZERO2", "simplefsdp_aot_eager"),)),
)
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
