"""simplefsdp over tensor parallel: dp sharding composed with TP placements, dp-only collectives,
parity with one process (2 x 2 gloo ranks), graph structure at dp 8 x tp 8 (fake process group)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import simplefsdp
from simplefsdp._compat import StridedShard
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs, tensor_parallel_plan
from simplefsdp.passes.collectives import find_collectives, is_all_gather, is_all_reduce, is_reduce_scatter
from simplefsdp.passes.detect import find_fsdp_reductions
from tests._tiers import fast_first
from tests.simplefsdp import _tp

# tp 8 needs heads and ffn divisible by 8; the vocabulary (67) still shards unevenly
L4 = TransformerArgs(vocab_size=67, dim=64, n_layers=4, n_heads=8, ffn_dim=176, max_seq_len=16)


@functools.cache
def _reference() -> _tp.TrainResult:
    return _tp.train_reference()


def _assert_matches_reference(result: _tp.TrainResult) -> None:
    losses, norms, params = result
    ref_losses, ref_norms, ref_params = _reference()
    # fp32; TP and DP change the summation order of matmuls and reductions: a few ulps
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=1e-6)
    assert params.keys() == ref_params.keys()
    for fqn, value in params.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=fqn)


@pytest.mark.parametrize("backend", fast_first(["eager", "aot_eager", "inductor"]))
def test_fsdp_tp_2x2_matches_one_process(ranks4, backend):
    """(dp 2, tp 2), sequence parallel, FULL_SHARD: losses, global gradient norms (clip_grad_norm_)
    and parameters after 5 SGD steps equal the single-process run; every rank agrees."""
    results = ranks4.run(_tp.train_simplefsdp_tp, backend, "FULL_SHARD", (2, 2), ("dp", "tp"))
    assert all(r[0] == results[0][0] for r in results), "every rank reports the same losses"
    _assert_matches_reference(results[0])


@pytest.mark.slow
def test_hybrid_shard_tp_3d_matches_one_process(ranks4):
    """HYBRID_SHARD on (replicate 2, shard 1, tp 2): the replicas' all-reduce over dp composed with TP.
    Eager: inductor's lowering of TP with sharding runs in the 2 x 2 test, of HYBRID's all-reduce in
    tests/simplefsdp/test_training.py."""
    results = ranks4.run(_tp.train_simplefsdp_tp, "eager", "HYBRID_SHARD", (2, 1, 2), ("replicate", "shard", "tp"))
    _assert_matches_reference(results[0])


def _tp_graphs(world, strategy, *, passes: bool):
    names = world.mesh_dim_names
    torch.manual_seed(0)
    model = Transformer(L4)
    parallelize_module(model, world["tp"], tensor_parallel_plan(model))
    dp = world[names[:-1]] if len(names) > 2 else world[names[0]]
    # the default pass (buckets per block), as wrap() configures it: on the dp groups only
    simplefsdp.wrap(model, dp, strategy=strategy, passes=simplefsdp.PassConfig() if passes else None)
    tokens = torch.randint(0, L4.vocab_size, (2, 8))
    # the pass wrap() attached runs in inductor's compile; with none, the aot backend gives the same
    # post-grad graphs without inductor's code generation
    backend = "inductor" if passes else "simplefsdp_aot_eager"
    graphs = record_step(model, lambda compiled: compiled(tokens).sum(), backend=backend)
    forward, backward = graphs.forward, graphs.backward
    groups = {name: tuple(world[name].mesh.flatten().tolist()) for name in names}  # this rank's groups' ranks
    return model, forward, backward, groups


@pytest.mark.slow
def test_dp8_tp8_graph_buckets_only_dp_collectives(fake_world64):
    """dp 8 x tp 8 (world 64): the FSDP collectives, and only they, run on the dp group, bucketed per
    block (L + 1 gathers forward, L + 1 re-gathers and L + 1 reduce-scatters backward); the TP
    collectives on the tp group are the same with and without our passes."""
    world = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
    model, forward, backward, groups = _tp_graphs(world, "FULL_SHARD", passes=True)
    _, plain_fwd, plain_bwd, _ = _tp_graphs(world, "FULL_SHARD", passes=False)

    for graph in (forward, backward, plain_fwd, plain_bwd):
        assert {c.ranks() for c in find_collectives(graph)} <= {groups["dp"], groups["tp"]}
    # the gradient reductions on tp (a sequence-parallel norm's weight: Partial over tp) look like
    # FSDP's structurally; restricted to the dp groups, as the model's pass is, only FSDP's remain
    tp_reductions = [r for r in find_fsdp_reductions(plain_bwd) if r.ranks() == groups["tp"]]
    assert tp_reductions, "the sequence-parallel norms' weights are reduced over tp"
    dp_only = find_fsdp_reductions(plain_bwd, groups={groups["dp"]})
    assert len(dp_only) == len(list(model.parameters()))

    def on(graph, group, predicate):
        return sum(1 for c in find_collectives(graph) if predicate(c.launch) and c.ranks() == groups[group])

    n_blocks = L4.n_layers
    # the rest in two runs: the embedding before the blocks (not re-gathered: its gradient needs no
    # weight), the norm + output after them
    assert on(forward, "dp", is_all_gather) == n_blocks + 2
    assert on(backward, "dp", is_all_gather) == n_blocks + 1
    assert on(backward, "dp", is_reduce_scatter) == n_blocks + 2
    assert on(backward, "dp", is_all_reduce) == 0
    n_params = len(list(model.parameters()))
    assert on(plain_fwd, "dp", is_all_gather) == n_params, "without passes: one gather per parameter"
    for graph, plain in ((forward, plain_fwd), (backward, plain_bwd)):
        for predicate in (is_all_gather, is_reduce_scatter, is_all_reduce):
            assert on(graph, "tp", predicate) == on(plain, "tp", predicate), "TP collectives untouched"
    assert on(plain_fwd, "tp", is_all_gather) + on(plain_fwd, "tp", is_reduce_scatter) > 0, "TP does communicate"

    # parameters: DTensors on the combined (dp, tp) mesh; dp sharding strided where TP shards dim 0
    params = dict(model.named_parameters())
    wq, wo, norm = (params[f"layers.0.{n}.weight"] for n in ("attention.wq", "attention.wo", "attention_norm"))
    assert wq.device_mesh.mesh_dim_names == ("dp", "tp")
    assert wq.placements == (StridedShard(0, split_factor=8), Shard(0))
    assert wo.placements == (Shard(0), Shard(1))
    assert norm.placements == (Shard(0), Replicate())
    assert wq.shape == (L4.dim, L4.dim)
    assert wq.to_local().shape == (L4.dim // 64, L4.dim)


@pytest.mark.slow
def test_hybrid_shard_tp_3d_graph(fake_world64):
    """HYBRID_SHARD on (replicate 4, shard 2, tp 8): gathers over `shard`, gradients reduce-scattered
    over `shard` and all-reduced over `replicate`, bucketed per block; nothing of FSDP on `tp`."""
    world = init_device_mesh("cpu", (4, 2, 8), mesh_dim_names=("replicate", "shard", "tp"))
    model, forward, backward, groups = _tp_graphs(world, "HYBRID_SHARD", passes=True)

    def on(graph, group, predicate):
        return sum(1 for c in find_collectives(graph) if predicate(c.launch) and c.ranks() == groups[group])

    buckets = L4.n_layers + 2  # the blocks, the embedding before them, the norm + output after them
    assert on(forward, "shard", is_all_gather) == buckets
    assert on(backward, "shard", is_reduce_scatter) == buckets
    assert on(backward, "replicate", is_all_reduce) == buckets
    assert on(forward, "replicate", is_all_gather) == 0
    wq = dict(model.named_parameters())["layers.0.attention.wq.weight"]
    assert wq.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert wq.placements == (Replicate(), StridedShard(0, split_factor=8), Shard(0))


def test_dp_mesh_from_another_parent_is_refused(fake_world64):
    world = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (64,), mesh_dim_names=("data",))
    model = Transformer(L4)
    parallelize_module(model, world["tp"], tensor_parallel_plan(model))
    with pytest.raises(ValueError, match=r"tok_embeddings\.weight.*not part of the same parent mesh"):
        simplefsdp.wrap(model, other)
    with pytest.raises(ValueError, match="pass the data-parallel submesh"):
        simplefsdp.wrap(model)  # the default 1-D mesh over the world cannot be the dp mesh of a TP model
    tp_first = init_device_mesh("cpu", (8, 8), mesh_dim_names=("tp2", "dp2"))
    flipped = Transformer(L4)
    parallelize_module(flipped, tp_first["tp2"], tensor_parallel_plan(flipped))
    with pytest.raises(ValueError, match="must come before"):
        simplefsdp.wrap(flipped, tp_first["dp2"])
