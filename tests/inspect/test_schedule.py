"""The two-stream replay on a hand-built graph: what `overlap` in a profile does to exposed time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.inspect.schedule import simulate
from simplefsdp.passes import cost

aten = torch.ops.aten


def _gather_behind_a_matmul() -> fx.Graph:
    """launch all-gather; mm (compute); wait; use."""
    with FakeTensorMode() as mode:
        shard, x = mode.from_tensor(torch.zeros(512, 1024)), mode.from_tensor(torch.zeros(1024, 1024))
        full, y = c10d.all_gather_into_tensor.default(shard, 2, "0"), aten.mm.default(x, x)
    graph = fx.Graph()
    s, a = graph.placeholder("shard"), graph.placeholder("x")
    s.meta["val"], a.meta["val"] = shard, x
    launch = graph.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
    mm = graph.call_function(aten.mm.default, (a, a))
    wait = graph.call_function(c10d.wait_tensor.default, (launch,))
    launch.meta["val"], mm.meta["val"], wait.meta["val"] = full, y, full
    graph.output((wait, mm))
    return graph


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_overlap_share_of_hidden_time_is_charged(overlap):
    device = dataclasses.replace(cost.profile("cpu-gloo"), overlap=overlap)
    graph = _gather_behind_a_matmul()
    comm = cost.collective_seconds(device, kind="all_gather", nbytes=1024 * 1024 * 4, world=2)
    compute = 2 * 1024**3 / device.flops_per_s
    schedule = simulate(graph, device=device, phase="forward")
    hidden = min(comm, compute)
    expected = (comm - hidden) + (1 - overlap) * hidden
    assert schedule.exposed_s == pytest.approx(expected, rel=1e-9)
    assert schedule.comm[0].exposed_s == pytest.approx(expected, rel=1e-9)
