"""bench/_harness.spawn: a rank that dies after every rank finished does not lose the results; one
that dies before does fail the run ([Note: a rank that dies after finishing] in simplefsdp/ranks.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _harness  # bench/ is not a package: its scripts import it the same way

pytestmark = pytest.mark.slow


def _worker(rank: int, when: str, results: dict) -> None:
    if rank == 1 and when == "working":
        os.abort()
    results[rank] = rank + 10
    if rank == 1:
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()  # this spawned process only


def test_a_rank_that_dies_in_teardown_keeps_the_results():
    assert _harness.spawn(_worker, "tearing down") == {0: 10, 1: 11}
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        _harness.spawn(_worker, "working")
