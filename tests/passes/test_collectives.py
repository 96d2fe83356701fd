"""The collective parser, predicates and graph walks on small hand-built FX graphs (no process group needed)."""

from __future__ import annotations

import torch
from torch import fx

from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.gather import OWNER_KEY
from simplefsdp.passes.collectives import (
    collective_counts,
    derives_from_all_gather,
    find_collectives,
    is_data_movement,
    merge_repeated_waits,
    parse_collective,
)
from simplefsdp.passes.walk import reaches, upstream, walk

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
    vals = {
        "shard": torch.empty(2, 4),
        "x": torch.empty(3, 16, dtype=torch.bfloat16),
        "cast": torch.empty(2, 4, dtype=torch.bfloat16),
        "gather": torch.empty(16, 4, dtype=torch.bfloat16),
        "mm": torch.empty(3, 4, dtype=torch.bfloat16),
        "rs": torch.empty(3, 4, dtype=torch.bfloat16),  # a made-up size: only its bytes are read
    }
    for name, val in vals.items():
        n[name].meta["val"] = val
    n["gather"].meta["custom"] = {OWNER_KEY: "layers.0.w"}
    return fx.GraphModule(torch.nn.Module(), g), n


def test_collective_counts():
    gm, _ = _graph()
    assert collective_counts(gm.graph) == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "wait": 2}


def test_a_launch_read_by_two_waits_gets_one():
    """[Note: a launch with two waits]: inductor's CSE leaves one reduce-scatter read by two waits."""
    gm, n = _graph()
    g = gm.graph
    (output,) = g.find_nodes(op="output")
    with g.inserting_before(output):
        second = g.call_function(c10d.wait_tensor.default, (n["rs"],))
    output.args = ((*output.args[0], second),)
    assert parse_collective(n["rs"]).wait is None, "two users: not a recognisable wait"
    assert merge_repeated_waits(g) == 1
    g.lint()
    assert parse_collective(n["rs"]).wait is n["rs_wait"]
    assert output.args[0][-2:] == (n["rs_wait"], n["rs_wait"])
    assert collective_counts(g)["wait"] == 2, "the gather's wait and one reduction wait"
    assert merge_repeated_waits(g) == 0, "nothing left to merge"


def test_parse_collective_reads_each_kind_once():
    gm, n = _graph()
    gather = parse_collective(n["gather"])
    assert (gather.kind, gather.group_name, gather.group_size, gather.reduce_op) == ("all_gather", "0", 8, None)
    assert gather.wait is n["wait"]
    assert gather.sent is n["cast"]
    assert gather.dtype == torch.bfloat16
    assert gather.nbytes == 2 * 4 * 2, "what this rank sends: its bf16 shard"
    assert gather.full_nbytes == 16 * 4 * 2, "the gathered output"
    assert gather.owner == "layers.0.w"
    scatter = parse_collective(n["rs"])
    assert (scatter.kind, scatter.group_size, scatter.reduce_op) == ("reduce_scatter", 8, "avg")
    assert scatter.full_nbytes == scatter.nbytes == 3 * 4 * 2, "a reduction's full buffer is its input"
    assert scatter.owner == ""
    assert [parse_collective(n[k]) for k in ("wait", "mm", "shard")] == [None, None, None]
    assert [c.launch for c in find_collectives(gm.graph)] == [n["gather"], n["rs"]]
    assert [c.launch for c in find_collectives(gm.graph, kinds=["reduce_scatter"])] == [n["rs"]]


def test_a_launch_with_another_user_has_no_single_wait():
    gm, n = _graph()
    with gm.graph.inserting_after(n["gather"]):
        gm.graph.call_function(aten.clone.default, (n["gather"],))
    assert parse_collective(n["gather"]).wait is None


def test_walks():
    _, n = _graph()
    assert set(walk([n["t"]], follow=lambda node: node.all_input_nodes)) == {
        n["t"],
        n["wait"],
        n["gather"],
        n["cast"],
        n["shard"],
    }
    region = upstream(n["gather"], through=is_data_movement)
    assert (region.inside, region.boundary) == ([n["cast"]], [n["shard"]])
    assert upstream(n["rs"], through=is_data_movement).boundary == [n["mm"]], "a matmul is not data movement"
    assert reaches(n["mm"], found=lambda node: node is n["shard"], follow=lambda node: node.all_input_nodes)
    assert not reaches(n["x"], found=lambda node: node is n["shard"], follow=lambda node: node.all_input_nodes)


def test_derives_from_all_gather_sees_through_waits_and_views_but_not_compute():
    _, n = _graph()
    assert derives_from_all_gather(n["wait"])
    assert derives_from_all_gather(n["t"])
    assert not derives_from_all_gather(n["mm"]), "a matmul output is an activation, not a gathered weight"
    assert not derives_from_all_gather(n["shard"])
    assert not derives_from_all_gather(n["rs_wait"])
