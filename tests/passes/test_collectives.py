"""The collective predicates on small hand-built FX graphs (no process group needed)."""

from __future__ import annotations

import torch
from torch import fx

from simplefsdp.passes.collectives import collective_counts, derives_from_all_gather

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """shard -> cast -> all_gather -> wait -> t -> mm(x, .) ; and a reduce_scatter of mm's output."""
    g = fx.Graph()
    n = {}
    n["shard"], n["x"] = g.placeholder("shard"), g.placeholder("x")
    n["cast"] = g.call_function(torch.ops.prims.convert_element_type.default, (n["shard"], torch.bfloat16))
    n["gather"] = g.call_function(c10d.all_gather_into_tensor.default, (n["cast"], 8, "0"))
    n["wait"] = g.call_function(c10d.wait_tensor.default, (n["gather"],))
    n["t"] = g.call_function(aten.t.default, (n["wait"],))
    n["mm"] = g.call_function(aten.mm.default, (n["x"], n["t"]))
    n["rs"] = g.call_function(c10d.reduce_scatter_tensor.default, (n["mm"], "avg", 8, "0"))
    n["rs_wait"] = g.call_function(c10d.wait_tensor.default, (n["rs"],))
    g.output((n["t"], n["mm"], n["rs_wait"]))
    return fx.GraphModule(torch.nn.Module(), g), n


def test_collective_counts():
    gm, _ = _graph()
    assert collective_counts(gm) == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "wait": 2}


def test_derives_from_all_gather_sees_through_waits_and_views_but_not_compute():
    _, n = _graph()
    assert derives_from_all_gather(n["wait"])
    assert derives_from_all_gather(n["t"])
    assert not derives_from_all_gather(n["mm"]), "a matmul output is an activation, not a gathered weight"
    assert not derives_from_all_gather(n["shard"])
    assert not derives_from_all_gather(n["rs_wait"])
