"""The test harness's rank pool: a rank stuck in a task is killed, and the pool serves the next test."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests._dist import RankPool

pytestmark = pytest.mark.slow  # see tests/_tiers.py


def _stuck_on_rank_1(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_stuck_rank_is_killed_and_the_pool_restarts():
    pool = RankPool(world_size=2, timeout_s=60.0)
    try:
        assert pool.run(_stuck_on_rank_1, 0.0) == [0, 1]  # started (spawning takes seconds)
        pool.timeout_s = 15.0  # rank 0 answers at once, even on a loaded machine; rank 1 never
        with pytest.raises(TimeoutError, match=r"did not finish on ranks \[1\] within 15s"):
            pool.run(_stuck_on_rank_1, 600.0)
        assert not pool._procs, "the stuck ranks were not torn down"
        assert pool.run(_stuck_on_rank_1, 0.0) == [0, 1], "a fresh pool serves the next task"
    finally:
        pool.close()
