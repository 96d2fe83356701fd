"""Tied, frozen and mixed-dtype parameters, and gradient clipping, with simplefsdp (2 gloo ranks, and
graph structure at world 8 on the fake process group).

Tolerance vs the single-process reference: the fp32 bound of `test_training.py` (64 ulps), for
the same reason (each rank reduces over half the batch, a different summation order).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import simplefsdp
from simplefsdp.gather import OWNER_KEY
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer
from simplefsdp.passes.collectives import collective_counts, is_reduce_scatter
from tests._tiers import fast_first
from tests.simplefsdp import _accumulate as accumulate
from tests.simplefsdp import _compose as compose
from tests.simplefsdp import _training as training
from tests.simplefsdp.test_training import FP32_TOL

BACKENDS = ["eager", "aot_eager", "inductor"]


@functools.cache
def _lora_reference() -> compose.LoraResult:
    return compose.train_lora_reference()


def test_tied_parameter_gathered_and_reduced_once(fake_world8):
    """The tied embedding / output weight: one all-gather in forward, one reduce-scatter in backward;
    frozen parameters: gathered, never reduced."""
    model = simplefsdp.wrap(compose.lora_model())
    unique = dict(model.named_parameters())  # a tied parameter is listed once
    trainable = {fqn for fqn, p in unique.items() if p.requires_grad}
    tokens = torch.randint(0, compose.TIED.vocab_size, (2, 8))
    graphs = record_step(model, lambda compiled: compiled(tokens).sum(), backend="simplefsdp_aot_eager")

    fwd, bwd = collective_counts(graphs.forward_pre), collective_counts(graphs.backward_pre)
    assert fwd["all_gather"] == len(unique)
    reduced = [n.meta.get("custom", {}).get(OWNER_KEY) for n in graphs.backward_pre.nodes if is_reduce_scatter(n)]
    assert sorted(reduced) == sorted(trainable), "one reduce-scatter per trainable parameter, none for frozen ones"
    assert reduced.count("tok_embeddings.weight") == 1
    assert bwd["all_reduce"] == 0
    assert compose.frozen_fqns(model)
    assert not compose.frozen_fqns(model) & set(reduced)


@pytest.mark.parametrize("backend", fast_first(BACKENDS, fast=2))
def test_tied_frozen_lora_training_matches_reference(ranks2, backend):
    results = ranks2.run(compose.train_lora_simplefsdp, backend)
    ours, reference = results[0], _lora_reference()
    assert results[1].losses == ours.losses
    assert ours.tied_is_one_parameter
    assert reference.tied_is_one_parameter
    assert ours.frozen_grads == [], "frozen parameters must get no gradient"
    assert ours.dtypes == reference.dtypes
    assert {torch.bfloat16, torch.float32} <= set(ours.dtypes.values())
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(reference.losses), **FP32_TOL)
    for fqn, value in reference.params.items():
        torch.testing.assert_close(ours.params[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    frozen = [fqn for fqn, dtype in ours.dtypes.items() if dtype == torch.bfloat16]
    untrained = compose.lora_model().state_dict()
    for fqn in frozen:  # frozen parameters did not move at all
        assert torch.equal(ours.params[fqn], untrained[fqn])
    moved = [fqn for fqn in ours.params if fqn not in frozen and not torch.equal(ours.params[fqn], untrained[fqn])]
    assert len(moved) == len(ours.params) - len(frozen), "every trainable parameter must have been updated"


@pytest.mark.parametrize("backend", fast_first(["eager", "inductor"]))
def test_clip_grad_norm_is_global(ranks2, backend):
    """`clip_grad_norm_` on the sharded gradients returns the whole model's norm and clips like one process."""
    want_norm, want_grads = compose.clip_once("reference", 0.05)
    for norm, grads in ranks2.run(compose.clip_once, backend, 0.05):
        assert want_norm > 0.05, "the test must actually clip"
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), **FP32_TOL)
        for fqn, grad in want_grads.items():
            torch.testing.assert_close(grads[fqn], grad, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


def test_tied_parameter_reduced_once_in_eager(fake_world8):
    model = simplefsdp.wrap(compose.lora_model())
    unique = dict(model.named_parameters())
    tokens = torch.randint(0, compose.TIED.vocab_size, (2, 8))
    with CommDebugMode() as comm:
        model(tokens).sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {
        "c10d_functional.all_gather_into_tensor": len(unique),
        "c10d_functional.reduce_scatter_tensor": len([p for p in unique.values() if p.requires_grad]),
    }


@functools.cache
def _unchecked_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return compose.train_checkpointed("reference", None)


@pytest.mark.parametrize(
    ("backend", "policy"),
    fast_first([("eager", "full"), ("aot_eager", "full"), ("inductor", "full"), ("inductor", "selective")], rows=True),
)
def test_activation_checkpointing_matches_reference(ranks2, backend, policy):
    """Every block checkpointed (full / selective) and FULL_SHARD: training equals the unsharded,
    uncheckpointed single process."""
    want_losses, want_params = _unchecked_reference()
    losses, params = ranks2.run(compose.train_checkpointed, backend, policy)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **FP32_TOL)
    for fqn, value in want_params.items():
        torch.testing.assert_close(params[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


@pytest.mark.parametrize("policy", fast_first(["full", "selective"]))
def test_activation_checkpointing_adds_no_gather(fake_world8, policy):
    """Checkpointed blocks under FULL_SHARD: backward re-gathers each parameter once, exactly as
    without checkpointing (the recomputation's gather is the backward's), and saves fewer tensors."""

    def step_graphs(checkpointed: bool):
        torch.manual_seed(0)
        model = Transformer(training.ARGS)
        if checkpointed:
            assert simplefsdp.checkpoint_blocks(model, policy=policy) == ["layers.0", "layers.1"]
        simplefsdp.wrap(model, passes=None)
        tokens = torch.randint(0, training.ARGS.vocab_size, (2, 8))
        torch.compiler.reset()
        return record_step(model, lambda compiled: compiled(tokens).sum(), backend="simplefsdp_aot_eager")

    plain, checkpointed = step_graphs(False), step_graphs(True)
    n_params = len(list(Transformer(training.ARGS).parameters()))
    for graphs in (plain, checkpointed):
        assert collective_counts(graphs.forward)["all_gather"] == n_params
        assert collective_counts(graphs.backward)["all_gather"] == n_params - 1, (
            "one re-gather each (not the embedding)"
        )
        assert collective_counts(graphs.backward)["reduce_scatter"] == n_params
    assert len(checkpointed.saved_for_backward()) < len(plain.saved_for_backward()), "activations are recomputed"


def test_checkpoint_blocks_errors():
    model = Transformer(training.ARGS)
    with pytest.raises(ValueError, match="unknown checkpoint policy 'most'"):
        simplefsdp.checkpoint_blocks(model, policy="most")
    with pytest.raises(ValueError, match=r"no submodules named \['layers.9'\]"):
        simplefsdp.checkpoint_blocks(model, blocks=["layers.9"])
    simplefsdp.checkpoint_blocks(model)
    with pytest.raises(ValueError, match="already checkpointed"):
        simplefsdp.checkpoint_blocks(model, blocks=["layers.1"])
    with pytest.raises(ValueError, match="no repeated blocks"):
        simplefsdp.checkpoint_blocks(torch.nn.Linear(2, 2))


# aot_eager: test_no_sync_matches_ddp_semantics runs no_sync compiled, through the passes
@pytest.mark.parametrize("backend", fast_first(["eager", "inductor"]))
def test_no_sync_accumulation_equals_one_batch(ranks2, backend):
    """Two micro-batches, the first under `no_sync`, give the one-batch result; compiled, the graphs
    are all built in the first steps (deferring / reducing with pending gradients) and then reused."""
    accumulated = ranks2.run(compose.train_accumulating, backend, accumulate=True)
    whole = ranks2.run(compose.train_accumulating, backend, accumulate=False)
    (losses, params, compiled, deferred), (want_losses, want_params, _, _) = accumulated[0], whole[0]
    assert deferred == [len(params)] * len(losses), "each no_sync block must leave every gradient pending"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **FP32_TOL)
    for fqn, value in want_params.items():
        torch.testing.assert_close(params[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    if backend == "inductor":
        assert compiled[0] > 0
        assert compiled[-1] == compiled[1], f"recompiled after warm-up: graphs seen by the pass per step {compiled}"


def test_no_sync_defers_every_reduction(fake_world8):
    model = simplefsdp.wrap(training.fresh_model())
    tokens = torch.randint(0, training.ARGS.vocab_size, (2, 8))
    with CommDebugMode() as comm, simplefsdp.no_sync(model):
        model(tokens).sum().backward()
    assert set(map(str, comm.get_comm_counts())) == {"c10d_functional.all_gather_into_tensor"}
    # nothing reduced: each `.grad` is the zeros its deferred sum lives with (dropped if cleared)
    assert all(p.grad is not None and not p.grad.to_local().any() for p in model.parameters())
    with CommDebugMode() as comm:
        model(tokens).sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts["c10d_functional.reduce_scatter_tensor"] == len(list(model.parameters()))


def test_no_sync_needs_a_wrapped_model():
    with (
        pytest.raises(ValueError, match=r"no_sync\(\) needs the model simplefsdp.wrap\(\) returned; Linear"),
        simplefsdp.no_sync(torch.nn.Linear(2, 2)),
    ):
        pass
    with pytest.raises(ValueError, match=r"reduce_pending\(\) needs the model simplefsdp.wrap\(\) returned; Linear"):
        simplefsdp.reduce_pending(torch.nn.Linear(2, 2))


def test_reduce_pending_outside_no_sync_only(fake_world8):
    model = simplefsdp.wrap(torch.nn.Linear(2, 2))
    with simplefsdp.no_sync(model), pytest.raises(RuntimeError, match=r"reduce_pending\(\) inside .*no_sync"):
        simplefsdp.reduce_pending(model)


def test_meta_init_materializes_shards_like_one_process(ranks2):
    """Built on meta, wrapped, materialized: each rank holds only its shard, and the full values are
    bitwise those `torch.manual_seed(seed); Transformer(args)` gives in one process."""
    torch.manual_seed(7)
    reference = Transformer(training.ARGS)
    want = training.full_params(reference)
    with torch.no_grad():
        want_logits = reference(training.batches(1)[0][:, :-1])
    largest = max(v.numel() * v.element_size() for v in want.values())
    results = ranks2.run(compose.meta_materialize, 7)
    for params, _, peak, logits in results:
        torch.testing.assert_close(logits, want_logits, **FP32_TOL)  # buffers (rope tables) set too
        for fqn, value in want.items():
            assert torch.equal(params[fqn], value), f"{fqn} differs from the single-process init"
        assert 0 < peak <= largest, "at most one full parameter at a time"
    for fqn, value in want.items():  # the ranks' shards partition the parameter: nothing more is allocated
        per_rank = [local[fqn] for _, local, _, _ in results]
        assert sum(per_rank) == value.numel(), fqn
        assert per_rank[0] == -(-value.shape[0] // 2) * (value.numel() // value.shape[0]), fqn


def test_materialize_errors(fake_world8):
    with pytest.raises(ValueError, match=r"Linear has no sharded parameters: call simplefsdp\.wrap"):
        simplefsdp.materialize(torch.nn.Linear(2, 2))
    with torch.device("meta"):
        model = torch.nn.Linear(16, 4)
    simplefsdp.wrap(model)

    def view_init(m):
        m.weight.view(-1).zero_()

    with pytest.raises(RuntimeError, match=r"takes a view \(view\) of a sharded parameter of shape \(4, 16\)"):
        simplefsdp.materialize(model, init=view_init)

    real = simplefsdp.wrap(torch.nn.Sequential(torch.nn.Linear(16, 4)))
    with pytest.raises(ValueError, match=r"would overwrite tensors that are not on the meta device: '0.weight'"):
        simplefsdp.materialize(real)

    class Scale(torch.nn.Module):  # sets its parameter in __init__ only: nothing to replay
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.gain = torch.nn.Parameter(torch.ones(16))
            self.register_buffer("offset", torch.zeros(16))

    with torch.device("meta"):
        scale = Scale()
    simplefsdp.wrap(scale)
    with pytest.raises(ValueError, match=r"left 'gain', 'offset' uninitialized \(built on meta, never written\)"):
        simplefsdp.materialize(scale)

    class ResetScale(Scale):
        def reset_parameters(self):
            torch.nn.init.ones_(self.gain)
            torch.nn.init.zeros_(self.offset)

    with torch.device("meta"):
        reset_scale = ResetScale()
    simplefsdp.wrap(reset_scale)
    simplefsdp.materialize(reset_scale)
    assert torch.equal(reset_scale.offset, torch.zeros(16))
    with simplefsdp.sharded_parameters(reset_scale):
        assert torch.equal(reset_scale.gain.full_tensor(), torch.ones(16))


# [Note: what the no_sync tests compare]
# Each schedule runs on 2 ranks (each on half of every micro-batch) and in one process on whole
# micro-batches, where every backward adds to `.grad` as under DDP's no_sync; the gradients after
# each synchronizing backward must agree: within FP32_TOL (the halves' sum is a different order),
# and None exactly where the reference has None.
NO_SYNC_BACKENDS = ["eager", "simplefsdp_aot_eager"]
_AB, _A = accumulate.HEADS, ("a",)
NO_SYNC_SCHEDULES = {
    # head b is used by the first micro-batch only, then (next step) by the synchronizing one only
    "left-out-of-last": [
        accumulate.Backward(_AB, sync=False),
        accumulate.Backward(_A, sync=True),
        accumulate.Check(),
        accumulate.ZeroGrad("optimizer"),
        accumulate.Backward(_A, sync=False),
        accumulate.Backward(_AB, sync=True),
        accumulate.Check(),
    ],
    # every micro-batch deferred, then reduced on demand; the next step starts from nothing
    "reduce-pending": [
        accumulate.Backward(_AB, sync=False),
        accumulate.Backward(_A, sync=False),
        accumulate.ReducePending(),
        accumulate.Check(),
        accumulate.ZeroGrad("optimizer"),
        accumulate.Backward(_A, sync=True),
        accumulate.Check(),
    ],
    # a zero_grad between no_sync blocks (the next block's start drops the sums) ...
    **{
        f"zero-grad-{how}": [
            accumulate.Backward(_AB, sync=False),
            accumulate.ZeroGrad(how),
            accumulate.Backward(_A, sync=False),
            accumulate.Backward(_A, sync=True),
            accumulate.Check(),
        ]
        for how in ("optimizer", "optimizer-in-place", "model")
    },
    # ... and right before the synchronizing micro-batch (its forward drops them)
    "zero-grad-then-sync": [
        accumulate.Backward(_AB, sync=False),
        accumulate.ZeroGrad("optimizer-in-place"),
        accumulate.Backward(_A, sync=True),
        accumulate.Check(),
    ],
    # forwards that are never backpropagated keep the sums for the backward that comes: one using
    # every parameter, one using head a only (head b's sum is reduced right after it), one interrupted
    # by an exception inside the model
    "forwards-not-backpropagated": [
        accumulate.Backward(_AB, sync=False),
        accumulate.ForwardOnly(_AB),
        accumulate.ForwardOnly(_A),
        accumulate.ForwardOnly(_AB, fail=True),
        accumulate.Backward(_AB, sync=True),
        accumulate.Check(),
    ],
    # two forwards backpropagated together as loss1 + loss2: the sums added once, not twice
    "backward-together": [
        accumulate.Backward(_AB, sync=False),
        accumulate.BackwardTogether((_AB, _A)),
        accumulate.Check(),
    ],
}


@pytest.mark.parametrize("schedule", list(NO_SYNC_SCHEDULES))
@pytest.mark.parametrize("backend", fast_first(NO_SYNC_BACKENDS))
def test_no_sync_matches_ddp_semantics(ranks2, backend, schedule):
    """After each synchronizing backward, `.grad` holds every micro-batch's reduced gradient since the
    last zero_grad, as DDP's sums in `.grad` would: also for a parameter the synchronizing micro-batch
    does not use, nothing carried into the next step, and nothing from before a zero_grad."""
    ours = ranks2.run(accumulate.run_simplefsdp, backend, NO_SYNC_SCHEDULES[schedule])[0]
    want = accumulate.run_reference(NO_SYNC_SCHEDULES[schedule])
    for check, (got, expected) in enumerate(zip(ours, want, strict=True)):
        for fqn, value in expected.items():
            where = f"check {check}, {fqn}"
            if value is None:
                assert got[fqn] is None, f"{where}: has a gradient, the reference has none"
                continue
            assert got[fqn] is not None, f"{where}: has no gradient after the synchronizing backward"
            torch.testing.assert_close(got[fqn], value, **FP32_TOL, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.slow
def test_no_sync_sum_consumed_once_under_inductor(ranks2):
    """Inductor keeps the in-place zeroing of a consumed sum in its backward code: a forward never
    backpropagated, then two backpropagated together, add the sum exactly once."""
    schedule = [
        accumulate.Backward(_AB, sync=False),
        accumulate.ForwardOnly(_AB),
        accumulate.BackwardTogether((_AB, _A)),
        accumulate.Check(),
    ]
    (ours,) = ranks2.run(accumulate.run_simplefsdp, "inductor", schedule)[0]
    (want,) = accumulate.run_reference(schedule)
    for fqn, value in want.items():
        torch.testing.assert_close(ours[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


# Tolerance of the mixed-precision no_sync comparison: the emulated reference performs the same bf16
# computations on the same values, so the gradients match up to the reduction's order of additions
# (2 ranks: one fp32 rounding, 1 ulp relative); 4 fp32 ulps relative, with an absolute 4 ulps of
# the largest gradient for elements near zero. Rounding the fp32 sum to bf16 moves elements by up
# to 2**-9 relative (the negative control checks that this is visible).
def _mp_tol(reference: torch.Tensor) -> dict[str, float]:
    eps = torch.finfo(torch.float32).eps
    return {"rtol": 4 * eps, "atol": 4 * eps * reference.abs().max().item()}


@pytest.mark.parametrize("backend", NO_SYNC_BACKENDS)
def test_no_sync_sums_in_reduce_dtype(ranks2, backend):
    """param_dtype=bf16, reduce_dtype=fp32: the micro-batches' bf16 gradients are summed in fp32 and
    the sum is reduced in fp32, never rounded to bf16 on the way (as FSDP2 accumulates in reduce_dtype)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    schedule = [accumulate.Backward(_AB, sync=False), accumulate.Backward(_AB, sync=True), accumulate.Check()]
    (ours,) = ranks2.run(accumulate.run_simplefsdp, backend, schedule, param_dtype=bf16, reduce_dtype=fp32)[0]
    want = accumulate.emulate_policy(2, world=2, param_dtype=bf16, reduce_dtype=fp32)
    rounded = accumulate.emulate_policy(2, world=2, param_dtype=bf16, reduce_dtype=fp32, round_sums_to=bf16)
    for fqn, value in want.items():
        assert ours[fqn].dtype == fp32
        torch.testing.assert_close(ours[fqn], value, **_mp_tol(value), msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    # negative control: the comparison tells a sum rounded to bf16 before the reduction apart
    assert not all(torch.allclose(rounded[fqn], value, **_mp_tol(value)) for fqn, value in want.items())
