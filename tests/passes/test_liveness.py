"""The liveness walk on small hand-built graphs (no process group needed)."""

from __future__ import annotations

import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.passes.liveness import COMM_BUFFERS, REDUCED_GRADIENTS, Lifetimes, graph_peak, not_alike, peak_bytes

aten = torch.ops.aten
MIB = 2**20


def _reduce_then_compute() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """grad = mm(x, w) [1 MiB]; rs = reduce_scatter(grad); big = mm(x, w2) [2 MiB]; wait(rs); out."""
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(256, 256))
        w, w2 = mode.from_tensor(torch.zeros(256, 1024)), mode.from_tensor(torch.zeros(256, 2048))
        grad, big = aten.mm.default(x, w), aten.mm.default(x, w2)
        shard = c10d.reduce_scatter_tensor.default(grad, "sum", 2, "0")
    graph, n = fx.Graph(), {}

    def add(name: str, node: fx.Node, val: torch.Tensor) -> fx.Node:
        node.meta["val"] = val
        n[name] = node
        return node

    add("x", graph.placeholder("x"), x)
    add("w", graph.placeholder("w"), w)
    add("w2", graph.placeholder("w2"), w2)
    add("grad", graph.call_function(aten.mm.default, (n["x"], n["w"])), grad)
    add("rs", graph.call_function(c10d.reduce_scatter_tensor.default, (n["grad"], "sum", 2, "0")), shard)
    add("big", graph.call_function(aten.mm.default, (n["x"], n["w2"])), big)
    add("wait", graph.call_function(c10d.wait_tensor.default, (n["rs"],)), shard)
    graph.output((n["wait"], n["big"]))
    return graph, n


def test_a_collectives_input_lives_until_its_wait():
    """The gradient (1 MiB) is read by the reduce-scatter until its wait, so it is still alive when
    the 2 MiB matmul runs: at that matmul, x (0.25 MiB) and w2 (2) -- w (1) died after its last use
    -- plus grad 1, the reduce-scatter's output 0.5 and big 2."""
    graph, _ = _reduce_then_compute()
    peak = graph_peak(graph)
    assert peak.peak_bytes == MIB // 4 + 2 * MIB + 1 * MIB + MIB // 2 + 2 * MIB
    assert peak.at_peak[REDUCED_GRADIENTS] == MIB // 2
    assert peak.end_bytes == MIB // 2 + 2 * MIB, "what the graph returns"
    assert graph_peak(graph, skip_inputs={"x", "w", "w2"}).peak_bytes == 1 * MIB + MIB // 2 + 2 * MIB


def test_lifetimes_walk_the_current_order_after_moves():
    """One `Lifetimes` serves many orders of the same nodes: after the wait moves next to its launch
    (the gradient dies before the 2 MiB matmul) and back, each walk equals a fresh one."""
    graph, n = _reduce_then_compute()
    lifetimes = Lifetimes(graph)
    late = MIB // 4 + 2 * MIB + 1 * MIB + MIB // 2 + 2 * MIB
    assert lifetimes.peak() == late
    n["rs"].append(n["wait"])  # the wait right after its launch, before big
    early = MIB // 4 + 2 * MIB + MIB // 2 + 2 * MIB  # x, w2, the shard, big: the gradient is freed
    assert lifetimes.peak() == Lifetimes(graph).peak() == early
    along = lifetimes.along()
    assert list(along) == list(graph.nodes)
    assert max(along.values()) == early
    n["big"].append(n["wait"])
    assert lifetimes.peak() == late


def test_peak_bytes_counts_what_every_rank_holds_alike():
    """The pass's check counts a backward's inputs (saved activations: alike on every rank, freed at
    their last use, [Note: the backward's inputs count]) but not the shards a gather reads (a rank's
    shard may be smaller), nor what derives from them."""
    graph, n = _reduce_then_compute()
    assert peak_bytes(graph) == graph_peak(graph).peak_bytes == MIB // 4 + 2 * MIB + 1 * MIB + MIB // 2 + 2 * MIB
    with FakeTensorMode() as mode:
        shard = mode.from_tensor(torch.zeros(128, 1024))  # 0.5 MiB, gathered to 1 MiB
        full = c10d.all_gather_into_tensor.default(shard, 2, "0")
    with graph.inserting_before(n["grad"]):
        s = graph.placeholder("shard")
        s.meta["val"] = shard
        launch = graph.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
        wait = graph.call_function(c10d.wait_tensor.default, (launch,))
        launch.meta["val"] = wait.meta["val"] = full
    n["grad"].args = (n["x"], wait)  # the gathered weight replaces w
    graph.erase_node(n["w"])
    assert peak_bytes(graph) == MIB // 4 + 2 * MIB + 1 * MIB + MIB // 2 + 2 * MIB, "gathered 1 MiB, as w was"
    assert s in not_alike(graph)
    assert n["x"] not in not_alike(graph)


def test_comm_buffers_are_told_apart():
    with FakeTensorMode() as mode:
        shard = mode.from_tensor(torch.zeros(128, 256))
        full = c10d.all_gather_into_tensor.default(shard, 2, "0")
    graph = fx.Graph()
    s = graph.placeholder("shard")
    s.meta["val"] = shard
    launch = graph.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
    wait = graph.call_function(c10d.wait_tensor.default, (launch,))
    launch.meta["val"] = wait.meta["val"] = full
    graph.output((wait,))
    assert graph_peak(graph).at_peak[COMM_BUFFERS] == 256 * 256 * 4, "the gathered output"


def test_staging_is_held_from_launch_to_wait_where_the_profile_measured_it():
    """gloo stages about one full buffer per collective: 1 MiB for the reduce-scatter of the 1 MiB
    gradient, alive across the 2 MiB matmul; an all-gather factor changes nothing here."""
    graph, _ = _reduce_then_compute()
    plain = graph_peak(graph)
    staged = graph_peak(graph, staging={"reduce_scatter": 1.0, "all_gather": 5.0})
    assert staged.peak_bytes == plain.peak_bytes + 1 * MIB
    assert staged.at_peak[COMM_BUFFERS] == plain.at_peak.get(COMM_BUFFERS, 0) + 1 * MIB
    assert staged.end_bytes == plain.end_bytes, "freed at the wait"
    assert peak_bytes(graph) == plain.peak_bytes, "the pass's own check counts no staging"
