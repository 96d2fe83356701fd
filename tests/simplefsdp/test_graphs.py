"""Graph structure at world size 8 on the fake process group: which collectives each strategy traces."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.inspect.record import StepGraphs, record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts, derives_from_all_gather, find_collectives
from tests._tiers import fast_first

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
N_PARAMS = len(list(Transformer(ARGS).parameters()))
# The embedding's backward is a scatter-add of the output gradient: it never reads the weight, so
# FULL_SHARD re-gathers every parameter in backward except that one.
N_NEEDED_IN_BACKWARD = N_PARAMS - 1


def _trace(strategy: str, mp_policy: simplefsdp.MixedPrecisionPolicy | None = None) -> StepGraphs:
    """One step's graphs as traced (`*_pre`: before simplefsdp's pass), partitioned as inductor would."""
    parsed = simplefsdp.ShardingStrategy.parse(strategy)
    shape = (2, 4) if parsed.is_hybrid else (8,)
    mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy=parsed, mp_policy=mp_policy)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    return record_step(model, lambda compiled: compiled(tokens).float().sum(), backend="simplefsdp_aot_eager")


# strategy -> (forward all-gathers, backward all-gathers, reduce-scatters, all-reduces)
EXPECTED = {
    "FULL_SHARD": (N_PARAMS, N_NEEDED_IN_BACKWARD, N_PARAMS, 0),
    "SHARD_GRAD_OP": (N_PARAMS, 0, N_PARAMS, 0),
    "NO_SHARD": (0, 0, 0, N_PARAMS),
    "HYBRID_SHARD": (N_PARAMS, N_NEEDED_IN_BACKWARD, N_PARAMS, N_PARAMS),
    "HYBRID_SHARD_ZERO2": (N_PARAMS, 0, N_PARAMS, N_PARAMS),
}


@pytest.mark.parametrize("strategy", fast_first(EXPECTED))
def test_collectives_per_strategy(fake_world8, strategy):
    graphs = _trace(strategy)
    fwd, bwd = collective_counts(graphs.forward_pre), collective_counts(graphs.backward_pre)
    fwd_gathers, bwd_gathers, reduce_scatters, all_reduces = EXPECTED[strategy]

    assert fwd["all_gather"] == fwd_gathers
    assert fwd["reduce_scatter"] == fwd["all_reduce"] == 0, "the forward must reduce nothing"
    assert bwd["all_gather"] == bwd_gathers
    assert bwd["reduce_scatter"] == reduce_scatters
    assert bwd["all_reduce"] == all_reduces
    # every collective is waited on exactly once
    assert fwd["wait"] == sum(fwd[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))
    assert bwd["wait"] == sum(bwd[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))


@pytest.mark.parametrize(
    ("strategy", "reshards"),
    fast_first(
        [("FULL_SHARD", True), ("HYBRID_SHARD", True), ("SHARD_GRAD_OP", False), ("HYBRID_SHARD_ZERO2", False)],
        rows=True,
    ),
)
def test_reshard_after_forward_saves_no_gathered_weight(fake_world8, strategy, reshards):
    """ZeRO-3: the forward keeps no all-gathered weight alive for backward; ZeRO-2 keeps them."""
    saved_gathered = [n for n in _trace(strategy).saved_for_backward(pre=True) if derives_from_all_gather(n)]
    if reshards:
        assert saved_gathered == []
    else:
        assert len(saved_gathered) >= N_NEEDED_IN_BACKWARD


@pytest.mark.slow
def test_explicit_reshard_after_forward_overrides_strategy(fake_world8):
    mesh = init_device_mesh("cpu", (8,))
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy="SHARD_GRAD_OP", reshard_after_forward=True)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    graphs = record_step(model, lambda compiled: compiled(tokens).sum(), backend="simplefsdp_aot_eager")
    assert collective_counts(graphs.backward_pre)["all_gather"] == N_NEEDED_IN_BACKWARD
    assert not any(derives_from_all_gather(n) for n in graphs.saved_for_backward(pre=True))


@pytest.mark.parametrize("strategy", fast_first(["FULL_SHARD", "HYBRID_SHARD"]))
def test_mixed_precision_collective_dtypes(fake_world8, strategy):
    """bf16 all-gathers (forward and backward re-gather), fp32 reductions, fp32 masters and grads."""
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    graphs = _trace(strategy, policy)
    gathers = [c for g in (graphs.forward_pre, graphs.backward_pre) for c in find_collectives(g, kinds=["all_gather"])]
    reductions = find_collectives(graphs.backward_pre, kinds=["reduce_scatter", "all_reduce"])
    assert gathers
    assert reductions
    assert {c.dtype for c in gathers} == {torch.bfloat16}
    assert {c.dtype for c in reductions} == {torch.float32}


@pytest.mark.slow
def test_reduce_dtype_defaults_to_param_dtype(fake_world8):
    """As in FSDP2: with only param_dtype set, gradients are reduced in param_dtype."""
    graphs = _trace("FULL_SHARD", simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    reductions = find_collectives(graphs.backward_pre, kinds=["reduce_scatter"])
    assert {c.dtype for c in reductions} == {torch.bfloat16}
