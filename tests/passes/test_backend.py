"""How a bucket's reduce-scatter is issued per backend ([Note: gloo's reduce-scatter is an all-reduce of
a copy] in passes/backend.py): a reduce-scatter on the fake process group and on NCCL-profiled dry runs,
an in-place all-reduce plus a copy of this rank's slot on gloo -- and so in dry runs for a gloo profile."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.backend import reduces_in_place, simulating
from simplefsdp.passes.collectives import collective_counts, find_collectives
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.liveness import graph_peak

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
ONE_BUCKET = PassConfig(bucket=BucketConfig(plan="cap", cap_bytes=2**30))


def _backward(world: int):
    torch.compiler.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = simplefsdp.wrap(Transformer(ARGS), mesh, passes=None)  # the pass under test runs instead
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    graphs = record_step(
        model, lambda compiled: compiled(tokens).sum(), graph_pass=FsdpPass(ONE_BUCKET), backend="simplefsdp_aot_eager"
    )
    return graphs.post[1]


def _in_place_reductions(graph) -> list:
    return list(graph.find_nodes(op="call_function", target=c10d.all_reduce_.default))


def test_the_fake_group_keeps_the_reduce_scatter_and_a_gloo_dry_run_all_reduces_in_place(fake_world8):
    group = find_collectives(_backward(8))[0].group_name
    assert not reduces_in_place(group)
    plain = _backward(8)
    assert collective_counts(plain)["reduce_scatter"] == 1
    assert not _in_place_reductions(plain)

    with simulating("gloo"):
        assert reduces_in_place(group)
        gloo = _backward(8)
    assert not reduces_in_place(group), "the simulated backend ends with its block"
    counts = collective_counts(gloo)
    assert counts["reduce_scatter"] == 0
    assert counts["all_reduce"] == 1
    (launch,) = _in_place_reductions(gloo)
    flat = launch.args[0]
    assert flat.target is torch.ops.simplefsdp.reduce_scatter_copy_in.default, "only the pass's own buffer"
    assert list(flat.users) == [launch]
    (wait,) = launch.users
    (slot,) = wait.users
    assert slot.target is torch.ops.simplefsdp.rank_slot.default, "a copy: the shards own their storage"
    assert slot.args[1:] == (group, flat.meta["val"].numel() // 8), "the rank's slot, an eighth; no rank in the graph"
    # the staging a gloo profile measures for a reduce-scatter (a full copy) is gone from what the
    # communication holds at most (this tiny graph peaks elsewhere, on its activations)
    staging = {"reduce_scatter": 1.0, "all_reduce": 0.0}
    held = {name: graph_peak(g, staging=staging).max_comm_bytes for name, g in (("gloo", gloo), ("rs", plain))}
    assert held["gloo"] < held["rs"], held


def _gloo_backward_counts() -> dict:
    graph = _backward(torch.distributed.get_world_size())
    launches = _in_place_reductions(graph)
    slots = [next(iter(next(iter(a.users)).users)) for a in launches]
    slots = [(str(s.target), s.args[2], a.args[0].meta["val"].numel()) for s, a in zip(slots, launches, strict=True)]
    return {**collective_counts(graph), "in_place": len(launches), "slots": slots}


def test_gloo_buckets_all_reduce_in_place(ranks2):
    """On a real gloo group: the bucket's reduction is the in-place all-reduce, and each rank copies
    its own slot out, the rank read when it runs (training with it is bitwise training without the
    pass: tests/simplefsdp/test_training.py)."""
    for counts in ranks2.run(_gloo_backward_counts):
        assert counts["in_place"] == counts["all_reduce"] == 1
        assert counts["reduce_scatter"] == 0
        ((target, n, numel),) = counts["slots"]
        assert (target, n) == (str(torch.ops.simplefsdp.rank_slot.default), numel // 2), "a copy of half the buffer"


def test_simulating_an_unknown_backend_is_not_gloo(fake_world8):
    group = find_collectives(_backward(8))[0].group_name
    with simulating("nccl"):
        assert not reduces_in_place(group)
    with pytest.raises(ValueError, match="inside"), simulating("gloo"):
        raise ValueError("inside")  # the block's exception passes through and the setting is reset
    assert not reduces_in_place(group)
