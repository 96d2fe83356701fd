"""simplefsdp's CPU ranks get gloo with one worker thread ([Note: torch's two gloo workers race]);
collectives, DTensor sharding and the checkpoint barrier run on it; `wrap()` warns once about a
group of torch's own gloo."""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import simplefsdp
from simplefsdp import gloo
from simplefsdp._compat import gloo_worker_threads
from simplefsdp.checkpoint.sync import wait_for_all_ranks
from simplefsdp.ranks import run_on_ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _groups(device: torch.device) -> dict:
    world = dist.group.WORLD
    plain = dist.new_group(backend="gloo")  # torch's own gloo: two worker threads
    records = _Records()
    logging.getLogger("simplefsdp.gloo").addHandler(records)
    for _ in range(2):  # the second wrap over the same group says nothing more
        simplefsdp.wrap(nn.Linear(4, 4), DeviceMesh.from_group(plain, "cpu"), passes=None)
    quiet = _Records()
    logging.getLogger("simplefsdp.gloo").addHandler(quiet)
    model = simplefsdp.wrap(nn.Linear(4, 4), passes=None)  # over the default (one-worker) group
    weight = dict(model.named_parameters())["weight"].full_tensor()  # gathered over the one-worker group
    gathered = funcol.all_gather_tensor(torch.full((2,), float(dist.get_rank())), 0, world).wait()
    wait_for_all_ranks(what="the test's barrier", timeout=datetime.timedelta(seconds=60))
    return {
        "backend": dist.get_backend(),
        "threads": (gloo_worker_threads(world), gloo_worker_threads(plain)),
        "warnings": records.messages,
        "after": quiet.messages,
        "gathered": gathered.tolist(),
        "weight_shape": tuple(weight.shape),
    }


def test_spawned_cpu_ranks_run_gloo_on_one_worker_and_wrap_warns_about_two():
    out = run_on_ranks(_groups, nproc=2, device_type="cpu", timeout=datetime.timedelta(seconds=60))
    assert out["backend"] == gloo.BACKEND
    assert gloo.is_gloo(out["backend"])
    assert out["threads"] == (1, 2), "the launcher's group: one worker; torch's init: two"
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "2 worker threads" in out["warnings"][0]
    assert "simplefsdp.gloo.backend()" in out["warnings"][0]
    assert out["after"] == [], "no warning for a one-worker group"
    assert out["gathered"] == [0.0, 0.0, 1.0, 1.0]
    assert out["weight_shape"] == (4, 4)
