"""`run_on_ranks`: rank 0's result comes back; a failing rank's error is reported, not swallowed."""

from __future__ import annotations

import functools
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


def _dies(when: str, how: str, device: torch.device) -> int:
    """Rank 1 ends (`how`: "abort" is SIGABRT, "exit" an exit code of 1) in its work, or after it,
    while its process group is torn down: after it had reported its result."""
    end = os.abort if how == "abort" else functools.partial(os._exit, 1)
    if dist.get_rank() == 1:
        if when == "working":
            end()
        dist.destroy_process_group = lambda *args, **kwargs: end()  # this spawned process only
    return dist.get_rank() + 10


@pytest.mark.slow
@pytest.mark.parametrize(("how", "shown"), [("abort", "signal SIGABRT"), ("exit", "exit code 1")])
def test_a_rank_that_crashes_after_reporting_fails_the_run(how, shown):
    """[Note: a rank that dies after finishing]: a crash is a failure, whether or not the rank had
    reported its result first; the error says which."""
    with pytest.raises(RankFailedError, match=rf"process 1 terminated with {shown}, after it had reported its result"):
        run_on_ranks(functools.partial(_dies, "tearing down", how), nproc=2, device_type="cpu")
    with pytest.raises(RankFailedError, match=rf"process 1 terminated with {shown}$"):
        run_on_ranks(functools.partial(_dies, "working", how), nproc=2, device_type="cpu")
