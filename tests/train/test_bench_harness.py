"""bench/_harness.spawn: a rank that dies fails the run, before or after its work ([Note: a rank that
dies after finishing] in simplefsdp/ranks.py)."""

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
    if rank == 1 and when == "tearing down":
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()  # this spawned process only


def test_a_rank_that_dies_fails_the_run():
    assert _harness.spawn(_worker, "finishing") == {0: 10, 1: 11}
    for when in ("working", "tearing down"):
        with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
            _harness.spawn(_worker, when)
