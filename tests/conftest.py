"""Shared fixtures: gloo rank pools (spawned once per test session) and the fake process group."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from simplefsdp._compat import init_fake_process_group
from tests._dist import RankPool


def pytest_configure(config):
    """[Note: a fresh compile cache per test session]
    Inductor's on-disk caches outlive a session: a graph compiled by another version of the pass
    would be served to this one whenever the incoming graph matches, and the tests that claim to
    test the pass would test that other version. Each session -- each worker process of the parallel
    suite -- compiles into its own directory (inherited by the spawned ranks and the torchrun jobs),
    shared by its tests and removed after."""
    config._simplefsdp_cache_dir = tempfile.mkdtemp(prefix="simplefsdp-test-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = config._simplefsdp_cache_dir


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_simplefsdp_cache_dir", ""), ignore_errors=True)


# [Note: one rank pool per session]
# Starting a pool spawns its ranks, each importing torch and simplefsdp and joining a gloo group:
# seconds per pool on a small machine, paid by every module that used one. A pool lives for the whole
# session instead. What a test runs on it cannot leak into the next: each call starts from a fresh
# compile state (`torch.compiler.reset()` in the rank), its arguments and results are pickled, and
# a rank that fails or hangs restarts the pool (`tests/_dist.py`).
@pytest.fixture(scope="session")
def ranks2():
    pool = RankPool(world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
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
