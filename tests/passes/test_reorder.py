"""Reordering on small hand-built graphs: the reductions' memory budget."""

from __future__ import annotations

import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.passes.reorder import ReorderConfig, reorder, reorder_reductions

aten = torch.ops.aten


def _two_gradients_reduced_late() -> fx.Graph:
    """g1 = mm, g2 = mm, then reduce-scatter g1, wait, reduce-scatter g2, wait; both waits are outputs."""
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.zeros(16, 4)), mode.from_tensor(torch.zeros(4, 4))
        grad = aten.mm.default(x, w)
        shard = c10d.reduce_scatter_tensor.default(grad, "sum", 8, "0")
    graph = fx.Graph()

    def add(node: fx.Node, val: torch.Tensor) -> fx.Node:
        node.meta["val"] = val
        return node

    inputs = [add(graph.placeholder("x"), x), add(graph.placeholder("w"), w)]
    g1 = add(graph.call_function(aten.mm.default, tuple(inputs)), grad)
    g2 = add(graph.call_function(aten.mm.default, tuple(inputs)), grad)
    waits = []
    for g in (g1, g2):
        rs = add(graph.call_function(c10d.reduce_scatter_tensor.default, (g, "sum", 8, "0")), shard)
        waits.append(add(graph.call_function(c10d.wait_tensor.default, (rs,)), shard))
    graph.output(tuple(waits))
    return graph


def _order(graph: fx.Graph) -> list[str]:
    names = {aten.mm.default: "mm", c10d.reduce_scatter_tensor.default: "RS", c10d.wait_tensor.default: "W"}
    return [names[n.target] for n in graph.nodes if n.target in names]


def test_a_budget_smaller_than_one_reduction_keeps_one_in_flight():
    """Launching the second reduce-scatter as soon as its gradient exists puts it before the first
    one's wait; with a budget of one byte the first is then waited before the second launches."""
    graph = _two_gradients_reduced_late()
    reorder_reductions(graph, config=ReorderConfig(max_in_flight_bytes=1))
    graph.lint()
    assert _order(graph) == ["mm", "RS", "mm", "W", "RS", "W"]


def test_a_large_budget_keeps_both_in_flight():
    graph = _two_gradients_reduced_late()
    reorder_reductions(graph, config=ReorderConfig(max_in_flight_bytes=2**30))
    graph.lint()
    assert _order(graph) == ["mm", "RS", "mm", "RS", "W", "W"]


def test_the_derived_budget_keeps_one_reduction_in_flight():
    """Without `max_in_flight_bytes` the reductions' budget is the largest reduction's input: two
    equal ones do not fit together, so the first is waited before the second launches."""
    graph = _two_gradients_reduced_late()
    result = reorder(graph, config=ReorderConfig())
    graph.lint()
    assert _order(graph) == ["mm", "RS", "mm", "W", "RS", "W"]
    assert result.budgets == (0, 16 * 4 * 4), "no gathers; one fp32 [16, 4] gradient"
    assert result.peak_after <= result.peak_before + result.allowance


def _adder(graph: fx.Graph):
    """`add(target, args, val)`: appends a call of `target` to `graph`, its `meta["val"]` set to `val`."""

    def add(target, args, val: torch.Tensor) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta["val"] = val
        return node

    return add


def _reduction_before_a_big_temporary() -> fx.Graph:
    """g1 = mm, reduce-scatter g1, wait; then a [64, 64] temporary lives and dies (the graph's peak);
    then g2 = mm, reduce-scatter g2, wait. Delaying g1's wait to g2's launch holds g1 across the peak."""
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.zeros(16, 4)), mode.from_tensor(torch.zeros(4, 4))
        big = mode.from_tensor(torch.zeros(64, 64))
        grad = aten.mm.default(x, w)
        shard = c10d.reduce_scatter_tensor.default(grad, "sum", 8, "0")
    graph = fx.Graph()
    add = _adder(graph)

    x_in, w_in, big_in = (graph.placeholder(name) for name in ("x", "w", "b"))
    x_in.meta["val"], w_in.meta["val"], big_in.meta["val"] = x, w, big
    g1 = add(aten.mm.default, (x_in, w_in), grad)
    wait1 = add(c10d.wait_tensor.default, (add(c10d.reduce_scatter_tensor.default, (g1, "sum", 8, "0"), shard),), shard)
    temporary = add(aten.mm.default, (big_in, big_in), big)
    scale = add(aten.sum.default, (temporary,), big.sum())
    g2 = add(aten.mul.Tensor, (add(aten.mm.default, (x_in, w_in), grad), scale), grad)
    wait2 = add(c10d.wait_tensor.default, (add(c10d.reduce_scatter_tensor.default, (g2, "sum", 8, "0"), shard),), shard)
    graph.output((wait1, wait2))
    return graph


def test_a_wait_is_delayed_only_where_the_live_bytes_leave_room():
    """[Note: placing by slack]: the default allowance (one reduction's input) lets g1's reduction
    stay in flight across the temporary; `max_peak_growth_bytes=0` does not, as that would raise the
    peak; neither moves the peak past its allowance."""
    graph = _reduction_before_a_big_temporary()
    result = reorder(graph, config=ReorderConfig())
    graph.lint()
    names = _order(graph)
    assert names.index("W") > names.index("mm", 2), "g1's wait after the temporary: in flight across it"
    assert result.peak_after == result.peak_before + 16 * 4 * 4, "g1 held across the peak"
    assert result.peak_after <= result.peak_before + result.allowance

    graph = _reduction_before_a_big_temporary()
    result = reorder(graph, config=ReorderConfig(max_peak_growth_bytes=0))
    graph.lint()
    assert _order(graph)[:4] == ["mm", "RS", "W", "mm"], "g1 waited before the temporary"
    assert (result.peak_after, result.allowance) == (result.peak_before, 0)


def _second_reduction_views_an_early_gradient() -> fx.Graph:
    """e = mm (an early gradient), e viewed flat; g1 = mm, reduce-scatter g1, wait; late = mm, viewed
    flat; cat(view of e, view of late) reduce-scattered. The second reduction's chain starts with
    the view of e, which sits before the first reduction even launches; its first buffer is the cat."""
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.zeros(16, 4)), mode.from_tensor(torch.zeros(4, 4))
        grad = aten.mm.default(x, w)
        flat = grad.view(64)
        both = aten.cat.default([flat, flat])
        shard1 = c10d.reduce_scatter_tensor.default(grad, "sum", 8, "0")
        shard2 = c10d.reduce_scatter_tensor.default(both, "sum", 8, "0")
    graph = fx.Graph()
    add = _adder(graph)

    x_in, w_in = graph.placeholder("x"), graph.placeholder("w")
    x_in.meta["val"], w_in.meta["val"] = x, w
    early = add(aten.view.default, (add(aten.mm.default, (x_in, w_in), grad), [64]), flat)
    g1 = add(aten.mm.default, (x_in, w_in), grad)
    wait1 = add(
        c10d.wait_tensor.default, (add(c10d.reduce_scatter_tensor.default, (g1, "sum", 8, "0"), shard1),), shard1
    )
    late = add(aten.view.default, (add(aten.mm.default, (x_in, w_in), grad), [64]), flat)
    both_node = add(aten.cat.default, ([early, late],), both)
    rs2 = add(c10d.reduce_scatter_tensor.default, (both_node, "sum", 8, "0"), shard2)
    graph.output((wait1, add(c10d.wait_tensor.default, (rs2,), shard2)))
    return graph


def test_a_wait_is_delayed_past_the_next_reductions_views_to_its_first_buffer():
    """[Note: a reduction starts at its first buffer]: the view of the early gradient holds no
    memory, so g1's wait moves past the late gradient's matmul, to just before the cat."""
    graph = _second_reduction_views_an_early_gradient()
    result = reorder(graph, config=ReorderConfig())
    graph.lint()
    assert _order(graph) == ["mm", "mm", "RS", "mm", "W", "RS", "W"], "g1 in flight across the late matmul"
    wait1 = next(n for n in graph.nodes if n.target == c10d.wait_tensor.default)
    assert wait1.next.target == aten.cat.default, "waited right before the next reduction's first buffer"
    assert result.peak_after <= result.peak_before + result.allowance


def test_a_reorder_that_grows_the_peak_too_much_is_undone(monkeypatch):
    """If the liveness walk finds the peak grew beyond the budget, the moves are undone and retried
    with less; when nothing fits, the graph keeps its original order."""
    from simplefsdp.passes import reorder as module

    graph = _two_gradients_reduced_late()
    original = _order(graph)
    walks = iter([100, *[10**9] * len(module._RETRY_FRACTIONS)])  # before, then every attempt: too much
    monkeypatch.setattr(module.Lifetimes, "peak", lambda self: next(walks))
    result = reorder(graph, config=ReorderConfig())
    graph.lint()
    assert _order(graph) == original
    assert (result.moved, result.peak_after) == (0, 100)


def test_only_the_given_groups_gathers_are_prefetched(fake_world8):
    """On a dp x tp mesh, a pass told its dp groups prefetches the dp all-gather and leaves the tp
    one where tensor parallelism put it."""
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.passes.collectives import group_ranks
    from simplefsdp.passes.reorder import reorder_all_gathers

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    names = {dim: mesh.get_group(dim).group_name for dim in ("dp", "tp")}
    with FakeTensorMode() as mode:
        square = mode.from_tensor(torch.zeros(4, 4))
        gathered = {"dp": torch.empty(8, 4), "tp": torch.empty(16, 4)}
    graph = fx.Graph()
    act = graph.placeholder("act")
    act.meta["val"] = square
    value = act
    for dim in ("dp", "tp"):
        shard = graph.placeholder(f"{dim}_shard")
        shard.meta["val"] = square
        size = mesh.size(mesh.mesh_dim_names.index(dim))
        launch = graph.call_function(c10d.all_gather_into_tensor.default, (shard, size, names[dim]))
        wait = graph.call_function(c10d.wait_tensor.default, (launch,))
        launch.meta["val"] = wait.meta["val"] = gathered[dim]
        value = graph.call_function(aten.mm.default, (value, value))  # this block's compute
        value.meta["val"] = square
        use = graph.call_function(aten.sum.default, (wait,))
        use.meta["val"] = square.sum()
        value = graph.call_function(aten.add.Tensor, (value, use))
        value.meta["val"] = square
    graph.output((value,))

    def launch_before_first_wait(dim: str) -> bool:
        nodes = list(graph.nodes)
        launch = next(n for n in nodes if n.target is c10d.all_gather_into_tensor.default and n.args[2] == names[dim])
        first_wait = next(n for n in nodes if n.target is c10d.wait_tensor.default)
        return nodes.index(launch) < nodes.index(first_wait)

    dp_ranks = [group_ranks(names["dp"])]
    assert reorder_all_gathers(graph, config=ReorderConfig(), groups=dp_ranks) == 0, "the dp gather is first already"
    assert not launch_before_first_wait("tp"), "the tp gather was not moved"
    graph.lint()
    assert reorder_all_gathers(graph, config=ReorderConfig()) == 1, "without the filter it would be prefetched"
    assert launch_before_first_wait("tp")
