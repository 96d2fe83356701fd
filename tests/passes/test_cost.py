"""The cost model: alpha-beta collectives and roofline compute on traced nodes."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp.passes import cost
from simplefsdp.passes.fsdp_pass import BucketConfig

H100 = cost.profile("h100")


def test_collective_seconds_alpha_beta():
    one_gib = 2**30
    ag = cost.collective_seconds(H100, kind="all_gather", nbytes=one_gib, world=8)
    assert ag == pytest.approx(H100.latency_s + 7 / 8 * one_gib / H100.bus_bytes_per_s)
    ar = cost.collective_seconds(H100, kind="all_reduce", nbytes=one_gib, world=8)
    assert ar - H100.latency_s == pytest.approx(2 * (ag - H100.latency_s)), "an all-reduce moves twice the bytes"
    assert cost.collective_seconds(H100, kind="all_gather", nbytes=10, world=8) == pytest.approx(
        H100.latency_s, rel=1e-3
    )


def _node(target, *shapes):
    with FakeTensorMode() as mode:
        vals = [mode.from_tensor(torch.empty(s)) for s in shapes]
        out = target(*vals)
    graph = fx.Graph()
    inputs = []
    for i, v in enumerate(vals):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = v
        inputs.append(node)
    node = graph.call_function(target, tuple(inputs))
    node.meta["val"] = out
    return node


def test_matmul_is_compute_bound_and_pointwise_memory_bound():
    mm = _node(torch.ops.aten.mm.default, (4096, 4096), (4096, 4096))
    assert cost.node_seconds(H100, mm) == pytest.approx(2 * 4096**3 / H100.flops_per_s)
    add = _node(torch.ops.aten.add.Tensor, (4096, 4096), (4096, 4096))
    assert cost.node_seconds(H100, add) == pytest.approx(3 * 4096**2 * 4 / H100.memory_bytes_per_s)
    view = _node(torch.ops.aten.t.default, (4096, 4096))
    assert cost.node_seconds(H100, view) == 0.0


def test_reshape_is_free_only_when_it_is_a_view():
    """A reshape of a contiguous tensor is a view (free); of a transposed one, a copy (memory bound);
    `getitem` picks one output of a multi-output op and moves nothing."""
    aten = torch.ops.aten
    with FakeTensorMode() as mode:
        contiguous = mode.from_tensor(torch.empty(64, 32))
        transposed = mode.from_tensor(torch.empty(32, 64)).t()
        flat, pieces = aten.reshape.default(contiguous, [-1]), aten.split.Tensor(contiguous, 32)
    graph = fx.Graph()
    x = graph.placeholder("x")
    reshape = graph.call_function(aten.reshape.default, (x, [-1]))
    split = graph.call_function(aten.split.Tensor, (x, 32))
    pick = graph.call_function(operator.getitem, (split, 0))
    x.meta["val"], reshape.meta["val"], split.meta["val"], pick.meta["val"] = contiguous, flat, pieces, pieces[0]
    assert cost.node_seconds(H100, reshape) == 0.0
    assert cost.node_seconds(H100, pick) == 0.0
    assert cost.node_seconds(H100, split) == 0.0, "split returns views"
    x.meta["val"] = transposed
    assert cost.node_seconds(H100, reshape) == pytest.approx(2 * 64 * 32 * 4 / H100.memory_bytes_per_s)


def test_unknown_profile_is_named():
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu'.*'h100'"):
        BucketConfig(plan="auto", device="tpu")
