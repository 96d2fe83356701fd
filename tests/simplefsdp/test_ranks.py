"""`run_on_ranks`: rank 0's result comes back; a failing rank's error is reported, not swallowed."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch
import torch.distributed as dist

from simplefsdp.ranks import RankFailedError, run_on_ranks


def _work(fail_with: type[Exception] | None, device: torch.device) -> tuple[int, int, str]:
    if fail_with is not None and dist.get_rank() == 1:
        raise fail_with("rank 1 cannot go on")
    return dist.get_rank(), dist.get_world_size(), device.type


@pytest.mark.slow
def test_rank_zero_result_and_failures():
    assert run_on_ranks(functools.partial(_work, None), nproc=2, device_type="cpu") == (0, 2, "cpu")
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 failed:.*RuntimeError: rank 1 cannot go on"):
        run_on_ranks(functools.partial(_work, RuntimeError), nproc=2, device_type="cpu")
    with pytest.raises(KeyError, match="rank 1 cannot go on"):  # a passthrough type is raised as it is
        run_on_ranks(functools.partial(_work, KeyError), nproc=2, device_type="cpu", passthrough=(KeyError,))


def _dies(when: str, device: torch.device) -> int:
    """Rank 1 aborts before finishing its work, or after it, while its process group is torn down."""
    if dist.get_rank() == 1:
        if when == "working":
            os.abort()
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()  # this spawned process only
    return dist.get_rank() + 10


@pytest.mark.slow
def test_a_rank_that_dies_after_finishing_does_not_lose_the_results(caplog):
    """[Note: a rank that dies after finishing]."""
    with caplog.at_level(logging.WARNING, logger="simplefsdp.ranks"):
        assert run_on_ranks(functools.partial(_dies, "tearing down"), nproc=2, device_type="cpu") == 10
    assert any("after every rank had finished" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(RankFailedError, match="SIGABRT"):
        run_on_ranks(functools.partial(_dies, "working"), nproc=2, device_type="cpu")
