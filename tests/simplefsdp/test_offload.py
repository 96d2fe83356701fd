"""Offload to host memory (`OffloadPolicy`): the policy's checks, training on gloo ranks, checkpoints
across policies, and the settings that map onto it.

On a CPU mesh the host is the device: the copies to and from the device are identity copies, and
everything else -- the copy ops in the compiled graphs, the passes around them, the gradients
landing through the copy back, the optimizer stepping the host shards -- runs as on a GPU. The
copies' placement in the graphs is tested in `tests/passes/test_host_copies.py`.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

import simplefsdp
from simplefsdp.train.config import parse_args
from tests._tiers import fast_first
from tests.simplefsdp import _ckpt as ckpt
from tests.simplefsdp import _training as training
from tests.simplefsdp.test_checkpoint import _assert_same_state
from tests.simplefsdp.test_training import FP32_TOL, _assert_results_close, _pool


def test_the_policy_takes_booleans_only():
    with pytest.raises(TypeError, match=r"OffloadPolicy\.pin_memory must be a bool, got 'yes'"):
        simplefsdp.OffloadPolicy(pin_memory="yes")


def test_tiers_name_the_policies():
    assert simplefsdp.OffloadPolicy.of_tier("none") is None
    assert simplefsdp.OffloadPolicy.of_tier("optimizer") == simplefsdp.OffloadPolicy(parameters=False)
    assert simplefsdp.OffloadPolicy.of_tier("all") == simplefsdp.OffloadPolicy()
    assert [simplefsdp.OffloadPolicy(parameters=p).tier for p in (False, True)] == ["optimizer", "all"]
    with pytest.raises(ValueError, match="offload tier must be one of none, optimizer, all; got 'some'"):
        simplefsdp.OffloadPolicy.of_tier("some")


def test_wrap_takes_an_offload_policy():
    expected = r"offload must be a simplefsdp\.OffloadPolicy, an OffloadPlan or None, got str"
    with pytest.raises(TypeError, match=expected):
        simplefsdp.wrap(training.fresh_model(), offload="all")


_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


@functools.cache
def _reference() -> training.Result:
    return training.train_reference()


# Every strategy compiled with the passes on: inductor for FULL_SHARD (the copy ops lowered as its
# fallback kernels), the others under `simplefsdp_aot_eager` (the same partitioned graphs and passes,
# run op by op: no code generation); HYBRID_SHARD_ZERO2 under the other tier.
_CASES = [
    ("FULL_SHARD", "eager", "all"),
    ("FULL_SHARD", "eager", "optimizer"),
    ("FULL_SHARD", "inductor", "all"),
    *((s, "simplefsdp_aot_eager", "all") for s in _STRATEGIES[1:] if s != "HYBRID_SHARD_ZERO2"),
    ("FULL_SHARD", "simplefsdp_aot_eager", "optimizer"),
    ("HYBRID_SHARD_ZERO2", "simplefsdp_aot_eager", "optimizer"),
]


@pytest.mark.parametrize(("strategy", "backend", "tier"), fast_first(_CASES, fast=2, rows=True))
def test_offloaded_training_matches_one_process_and_fsdp2_cpu_offload(request, strategy, backend, tier):
    """5 AdamW steps with a tier offloaded: the single-process reference within the fp32 bound of
    `test_training.py`, and FSDP2 with `CPUOffloadPolicy(pin_memory=False)` (eager, the same
    strategy) bitwise in eager and `simplefsdp_aot_eager` on a 1-D mesh, else within the bound.
    Under "optimizer" the forward reads the copies the device keeps: a copy left stale after a step
    would train on old weights.
    Compiled runs compile from scratch, so the passes bucket and reorder around the copies
    (checked: they merged and moved)."""
    pool = _pool(request, strategy)
    results = pool.run(
        training.train_simplefsdp,
        strategy,
        backend,
        offload=simplefsdp.OffloadPolicy.of_tier(tier),
        compile_caches=backend == "eager",
    )
    ours = results[0]
    for rank_result in results[1:]:
        _assert_results_close(rank_result, ours, tol=None)
    assert ours.losses[-1] < ours.losses[0]
    _assert_results_close(ours, _reference(), FP32_TOL)
    fsdp2 = pool.run(training.train_fsdp2, strategy, offload=strategy != "NO_SHARD")[0]
    bitwise = backend != "inductor" and not strategy.startswith("HYBRID")
    _assert_results_close(ours, fsdp2, None if bitwise else FP32_TOL)
    if backend != "eager" and strategy != "NO_SHARD":
        assert ours.collectives_merged > 0, ours
        assert ours.collectives_moved > 0, ours


@pytest.mark.parametrize("tier", fast_first(["all", "optimizer"]))
def test_offload_composes_with_mixed_precision_tied_weights_accumulation_clipping_and_checkpointing(ranks2, tier):
    """Eager, 2 ranks, 5 steps of everything at once (`_training.train_composed`): the gradient norms
    and the parameters are bitwise those of the same run without offload -- offload moves tensors
    between memories and changes no arithmetic -- and the run moved (a comparison that can fail)."""
    offloaded, kept = (
        pool_result[0]
        for pool_result in (
            ranks2.run(training.train_composed, "eager", tier),
            ranks2.run(training.train_composed, "eager", "none"),
        )
    )
    assert offloaded.losses == kept.losses
    assert all(norm > 0 for norm in kept.losses)
    initial = training.full_params(training.fresh_model())
    assert any(not torch.equal(kept.params[fqn], initial[fqn]) for fqn in kept.params if fqn in initial)
    for fqn, value in kept.params.items():
        assert torch.equal(offloaded.params[fqn], value), fqn


def test_a_plan_mixing_tiers_trains_like_no_offload(ranks2):
    """An `OffloadPlan` (a block per tier, the rest on the device): one optimizer steps host and
    device parameters together; eager, bitwise the run without offload."""
    plan = simplefsdp.OffloadPlan(tiers=(("layers.0", "optimizer"), ("layers.1", "all")))
    planned = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager", offload=plan)[0]
    kept = ranks2.run(training.train_simplefsdp, "FULL_SHARD", "eager")[0]
    assert planned.losses == kept.losses
    for fqn, value in kept.params.items():
        assert torch.equal(planned.params[fqn], value), fqn


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_policy(ranks2, tmp_path):
    """Saved with everything offloaded, resumed without offload, and the other way round: bitwise
    the uninterrupted run's parameters, optimizer state and losses."""
    steps, stop = 4, 2
    roots = {offload: str(tmp_path / f"saved-offload-{offload}") for offload in (True, False)}
    ranks2.run(
        ckpt.train_many,
        [(roots[o], {"strategy": "FULL_SHARD", "steps": steps, "stop_at": stop, "offload": o}) for o in roots],
    )
    uninterrupted, *resumed = ranks2.run(
        ckpt.train_many,
        [
            (None, {"strategy": "FULL_SHARD", "steps": steps}),
            *((roots[o], {"strategy": "FULL_SHARD", "steps": steps, "offload": not o}) for o in roots),
        ],
    )[0]
    for run in resumed:
        assert run.start_step == stop
        assert run.losses == uninterrupted.losses[stop:]
        _assert_same_state(run, uninterrupted)
    for root in roots.values():
        shutil.rmtree(root)


def test_accelerate_offload_params_maps_onto_full_offload():
    settings = simplefsdp.from_accelerate({"fsdp_offload_params": True})
    assert settings.wrap_kwargs()["offload"] == simplefsdp.OffloadPolicy()
    assert simplefsdp.from_accelerate({"fsdp_offload_params": False}).wrap_kwargs()["offload"] is None


def test_train_offload_flag():
    assert [parse_args(["--offload", tier]).offload for tier in ("optimizer", "all")] == ["optimizer", "all"]
    assert parse_args([]).offload == "none"
