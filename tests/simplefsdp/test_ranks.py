"""`run_on_ranks`: rank 0's result comes back; a failing rank's error is reported, not swallowed."""

from __future__ import annotations

import functools

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
