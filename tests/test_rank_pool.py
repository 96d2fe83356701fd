"""The test harness's rank pool: a rank stuck in a task is killed, a rank that crashes is named with
its signal and its Python stack, and the pool serves the next test."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests._dist import RankPool

pytestmark = pytest.mark.slow  # see tests/_tiers.py


def _stuck_on_rank_1(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _crash_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_a_stuck_rank_is_killed_and_the_pool_restarts():
    pool = RankPool(world_size=2, timeout_s=60.0)
    try:
        assert pool.run(_stuck_on_rank_1, 0.0) == [0, 1]  # started (spawning takes seconds)
        pool.timeout_s = 8.0  # rank 0 answers at once, even on a loaded machine; rank 1 never
        with pytest.raises(TimeoutError, match=r"did not finish on ranks \[1\] within 8s") as stuck:
            pool.run(_stuck_on_rank_1, 600.0)
        assert "rank 1: still running" in str(stuck.value)
        assert "in _stuck_on_rank_1" in str(stuck.value), "the live rank's stack is in the report"
        assert not pool._procs, "the stuck ranks were not torn down"
        assert pool.run(_stuck_on_rank_1, 0.0) == [0, 1], "a fresh pool serves the next task"
        with pytest.raises(AssertionError, match=r"no answer from \[1\]") as crashed:
            pool.run(_crash_on_rank_1)
        message = str(crashed.value)
        assert f"rank 1: exited with code {-signal.SIGSEGV}" in message, message
        assert "Segmentation fault" in message, message
        assert "in _crash_on_rank_1" in message, message
        assert pool.run(_stuck_on_rank_1, 0.0) == [0, 1], "a fresh pool serves the task after a crash"
    finally:
        pool.close()
