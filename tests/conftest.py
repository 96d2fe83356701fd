"""Shared fixtures: gloo rank pools (spawned once per test module) and the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from simplefsdp._compat import init_fake_process_group
from tests._dist import RankPool


@pytest.fixture(scope="module")
def ranks2():
    pool = RankPool(world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(world_size=4)
    yield pool
    pool.close()


def _fake_world(size: int):
    init_fake_process_group(rank=0, world_size=size)
    yield size
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fake_world8():
    """This process as rank 0 of a world of 8 on the "fake" backend: collectives trace but move no data."""
    yield from _fake_world(8)


@pytest.fixture(scope="module")
def fake_world64():
    """As `fake_world8`, a world of 64 (e.g. dp 8 x tp 8); a test module uses one fake world only."""
    yield from _fake_world(64)


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    """Each test compiles its own models: no dynamo cache entries or recompile counts carried over."""
    torch.compiler.reset()
    return
