"""The two-stream replay on a hand-built graph: what `overlap` in a profile does to exposed time."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.inspect.schedule import simulate
from simplefsdp.passes import cost

aten = torch.ops.aten


def _graph(*ops: str) -> fx.Graph:
    """A graph of `ops` in order: "launch" an all-gather of a 512 x 1024 shard over 2 ranks, "wait"
    for the oldest one not yet waited, "mm" a 1024^3 matmul; it returns every wait and matmul."""
    with FakeTensorMode() as mode:
        shard, x = mode.from_tensor(torch.zeros(512, 1024)), mode.from_tensor(torch.zeros(1024, 1024))
        full, y = c10d.all_gather_into_tensor.default(shard, 2, "0"), aten.mm.default(x, x)
    graph = fx.Graph()
    s, a = graph.placeholder("shard"), graph.placeholder("x")
    s.meta["val"], a.meta["val"] = shard, x
    pending, returned = [], []
    for op in ops:
        if op == "launch":
            node = graph.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
            node.meta["val"] = full
            pending.append(node)
        elif op == "wait":
            node = graph.call_function(c10d.wait_tensor.default, (pending.pop(0),))
            node.meta["val"] = full
            returned.append(node)
        else:
            node = graph.call_function(aten.mm.default, (a, a))
            node.meta["val"] = y
            returned.append(node)
    graph.output(tuple(returned))
    return graph


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_overlap_share_of_hidden_time_is_charged(overlap):
    device = dataclasses.replace(cost.profile("cpu-gloo"), overlap=overlap)
    graph = _graph("launch", "mm", "wait")
    comm = cost.collective_seconds(device, kind="all_gather", nbytes=1024 * 1024 * 4, world=2)
    compute = 2 * 1024**3 / device.flops_per_s
    schedule = simulate(graph, device=device, phase="forward")
    hidden = min(comm, compute)
    expected = (comm - hidden) + (1 - overlap) * hidden
    assert schedule.exposed_s == pytest.approx(expected, rel=1e-9)
    assert schedule.comm[0].exposed_s == pytest.approx(expected, rel=1e-9)


def test_wake_up_latency_grows_with_the_idle_stretch_before_a_collective():
    base = cost.profile("cpu-gloo")
    device = dataclasses.replace(base, wake_s=2e-3, wake_tau_s=10e-3)
    comm = cost.collective_seconds(device, kind="all_gather", nbytes=1024 * 1024 * 4, world=2)
    compute = 2 * 1024**3 / device.flops_per_s
    schedule = simulate(_graph("launch", "wait", "mm", "launch", "wait"), device=device, phase="forward")
    first, second = schedule.comm
    assert first.duration_s == pytest.approx(comm + 2e-3, rel=1e-9), "a graph's first collective: fully idle before"
    assert second.duration_s == pytest.approx(comm + 2e-3 * -math.expm1(-compute / 10e-3), rel=1e-9)
    assert schedule.exposed_s == pytest.approx(first.duration_s + second.duration_s, rel=1e-9), "nothing hides them"
    drifting = dataclasses.replace(device, drift=0.5)
    drifted = simulate(_graph("launch", "wait", "mm", "launch", "wait"), device=drifting, phase="forward")
    assert drifted.comm[0].duration_s == pytest.approx(first.duration_s), "no compute before the first"
    assert drifted.comm[1].duration_s == pytest.approx(second.duration_s + 0.5 * compute, rel=1e-9)
    plain = simulate(_graph("launch", "wait", "mm", "launch", "wait"), device=base, phase="forward")
    assert plain.exposed_s == pytest.approx(2 * comm, rel=1e-9), "no wake-up in the named profiles"


def test_a_launch_holds_the_compute_clock_and_only_once_when_exposed():
    """[Note: what a training step adds]: issuing a collective takes the caller's time, which no
    overlap hides; an exposed collective still costs its back-to-back time once, not that plus it."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), overlap=1.0)
    device = dataclasses.replace(base, launch=(("all_gather", 2e-4, 1e-11),))
    nbytes = 1024 * 1024 * 4
    issue = 2e-4 + 1e-11 * nbytes
    comm = cost.collective_seconds(device, kind="all_gather", nbytes=nbytes, world=2)
    compute = 2 * 1024**3 / device.flops_per_s
    assert compute > comm > issue, "the matmul hides the collective entirely"
    hidden = simulate(_graph("launch", "mm", "wait"), device=device, phase="forward")
    plain = simulate(_graph("launch", "mm", "wait"), device=base, phase="forward")
    assert plain.end_s == pytest.approx(compute, rel=1e-9)
    assert hidden.end_s == pytest.approx(compute + issue, rel=1e-9), "the launch on top of the compute"
    assert hidden.exposed_s == 0.0
    exposed = simulate(_graph("launch", "wait"), device=device, phase="forward")
    assert exposed.end_s == pytest.approx(comm, rel=1e-9), "back to back: the launch is part of its time"
    other_kind = dataclasses.replace(base, launch=(("reduce_scatter", 1e-3, 0.0),))
    assert simulate(_graph("launch", "mm", "wait"), device=other_kind, phase="forward").end_s == pytest.approx(
        compute, rel=1e-9
    ), "charged per kind"


def test_what_else_a_collective_costs_a_step_is_charged_on_top_hidden_or_exposed():
    """[Note: what a training step adds], what is left per collective: `step_collective_s` is paid
    once per collective on the compute clock, whether compute hides the collective or not."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), overlap=1.0)
    device = dataclasses.replace(base, step_collective_s=3e-4)
    for order in (("launch", "mm", "wait"), ("launch", "wait"), ("launch", "wait", "mm", "launch", "wait")):
        plain = simulate(_graph(*order), device=base, phase="forward")
        charged = simulate(_graph(*order), device=device, phase="forward")
        assert charged.end_s == pytest.approx(plain.end_s + order.count("launch") * 3e-4, rel=1e-9), order


@pytest.mark.parametrize("term", ["step_exposed_wait_s", "step_hidden_s"])
def test_a_wait_costs_what_calibration_measured_for_its_kind(term):
    """[Note: what a training step adds]: `step_exposed_wait_s` is paid at each wait with no compute
    between it and its launch (the collective's status is "exposed"), `step_hidden_s` at each wait
    with compute between (status "overlapped" or "partly exposed"), each at no other wait."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), overlap=1.0)
    device = dataclasses.replace(base, **{term: 5e-4})
    for order, exposed, hidden in (
        (("launch", "mm", "wait"), 0, 1),
        (("launch", "wait"), 1, 0),
        (("launch", "wait", "mm", "launch", "wait"), 2, 0),
        (("launch", "launch", "wait", "mm", "wait"), 1, 1),
        (("launch", "mm", "launch", "mm", "wait", "wait"), 0, 2),
    ):
        paid = exposed if term == "step_exposed_wait_s" else hidden
        plain = simulate(_graph(*order), device=base, phase="forward")
        charged = simulate(_graph(*order), device=device, phase="forward")
        assert sum(event.status == "exposed" for event in charged.comm) == exposed, order
        assert charged.end_s == pytest.approx(plain.end_s + paid * 5e-4, rel=1e-9), order
        assert charged.exposed_s == pytest.approx(plain.exposed_s + paid * 5e-4, rel=1e-9), "a stall"


def test_the_step_terms_add_what_was_measured_to_a_step_that_wakes_and_drifts():
    """[Note: the step terms add what was measured, no more]: with a wake-up and drift in the
    profile, a step of N collectives, E of them waited right after their launch, gains exactly
    `N * step_collective_s + E * step_exposed_wait_s` -- the fit's own terms -- however much compute
    runs between them; their seconds are not idle time that wakes the next collective up more. The
    same for `(N - E) * step_hidden_s`, the term a fit prices instead of the per-wait one."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), overlap=1.0, wake_s=2e-3, wake_tau_s=1e-3, drift=0.1)
    device = dataclasses.replace(base, step_collective_s=3e-4, step_exposed_wait_s=5e-4)
    hidden_device = dataclasses.replace(base, step_collective_s=3e-4, step_hidden_s=4e-4)
    for order, exposed in (
        (("launch", "wait", "mm", "launch", "wait", "mm", "launch", "wait"), 3),
        (("launch", "mm", "wait", "launch", "mm", "wait"), 0),
        (("launch", "wait", "launch", "mm", "wait", "mm", "launch", "wait"), 2),
    ):
        plain = simulate(_graph(*order), device=base, phase="forward")
        charged = simulate(_graph(*order), device=device, phase="forward")
        assert [e.duration_s for e in charged.comm] == pytest.approx([e.duration_s for e in plain.comm], rel=1e-9)
        added = order.count("launch") * 3e-4 + exposed * 5e-4
        assert charged.end_s == pytest.approx(plain.end_s + added, rel=1e-9), order
        hidden = simulate(_graph(*order), device=hidden_device, phase="forward")
        added = order.count("launch") * (3e-4 + 4e-4) - exposed * 4e-4
        assert hidden.end_s == pytest.approx(plain.end_s + added, rel=1e-9), order
