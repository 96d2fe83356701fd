"""Which implementation the copy ops run ([Note: kernel selection] in `copy_ops.py`), forced both ways.

Each test clears the cached choice first and after, and checks the one INFO line that states it.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

import simplefsdp.kernels
from simplefsdp.kernels import copy_ops, reference

LOGGER = "simplefsdp.kernels.copy_ops"


@pytest.fixture
def fresh_choice():
    copy_ops._kernel_choice.cache_clear()
    yield
    copy_ops._kernel_choice.cache_clear()


def _round_trip(world: int = 2) -> None:
    """The three ops on a small bucket against the reference (whichever implementation runs)."""
    fulls = [torch.randn(5, 3), torch.randn(4)]
    chunks = [reference.chunk_numel(f.shape, world) for f in fulls]
    got = torch.ops.simplefsdp.reduce_scatter_copy_in(fulls, world, torch.bfloat16, 0.5)
    assert torch.equal(got, reference.reduce_scatter_copy_in(fulls, world, torch.bfloat16, 0.5))
    shards = [f[: -(-f.shape[0] // world)].contiguous() for f in fulls]
    got = torch.ops.simplefsdp.all_gather_copy_in(shards, chunks, torch.float32)
    assert torch.equal(got, reference.all_gather_copy_in(shards, chunks, torch.float32))
    gathered = torch.randn(world * sum(chunks))
    outs = torch.ops.simplefsdp.all_gather_copy_out(gathered, chunks, [5, 3, 4], [2, 1], world)
    for o, e in zip(outs, reference.all_gather_copy_out(gathered, chunks, [(5, 3), (4,)], world), strict=True):
        assert torch.equal(o, e)


def _choices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_cpu_tensors_take_torch_ops_logged_once(fresh_choice, caplog, monkeypatch):
    monkeypatch.delenv("SIMPLEFSDP_TRITON_ON_CPU", raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    _round_trip()
    _round_trip()
    assert _choices(caplog) == [
        "simplefsdp copy ops on cpu: torch ops; CPU tensors (SIMPLEFSDP_TRITON_ON_CPU=1 routes them to "
        "Triton's interpreter)"
    ]


def test_without_triton_the_torch_ops_run(fresh_choice, caplog, monkeypatch):
    """Triton not importable (as on aarch64): the route to it asked for, the torch ops run instead,
    with the same results, and the log says why."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "simplefsdp.kernels.triton_copy", raising=False)
    monkeypatch.delattr(simplefsdp.kernels, "triton_copy", raising=False)
    monkeypatch.setenv("SIMPLEFSDP_TRITON_ON_CPU", "1")
    caplog.set_level(logging.INFO, logger=LOGGER)
    _round_trip()
    assert not copy_ops._use_triton(torch.empty(1))
    (line,) = _choices(caplog)
    assert line.startswith("simplefsdp copy ops on cpu: torch ops; Triton does not import (")
    assert "simplefsdp.kernels.triton_copy" not in sys.modules


def test_with_triton_the_kernel_runs(fresh_choice, caplog, monkeypatch):
    """Triton imports and supports the device (the CPU, in its interpreter): the kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SIMPLEFSDP_TRITON_ON_CPU", "1")
    from simplefsdp.kernels import triton_copy

    importlib.reload(triton_copy)  # decorated in interpreter mode
    if problem := triton_copy.interpreter_problem():
        pytest.skip(problem)  # refused by `supports`: see the test below
    launches = []
    launch = triton_copy.launch_bucket
    monkeypatch.setattr(triton_copy, "launch_bucket", lambda *a, **k: launches.append(1) or launch(*a, **k))
    caplog.set_level(logging.INFO, logger=LOGGER)
    _round_trip()
    assert len(launches) == 3
    assert _choices(caplog) == ["simplefsdp copy ops on cpu: Triton kernel"]
    reason = triton_copy.supports(torch.device("cuda"))
    assert reason == "Triton is in interpreter mode, which runs on the CPU, not on cuda"


def test_an_interpreter_that_cannot_run_the_kernel_is_refused_with_its_reason(fresh_choice, caplog, monkeypatch):
    """[Note: Triton 3.6's interpreter and NumPy 2.4]: the versions seen to fail are refused by name,
    those seen to work are not, and the copy ops then fall back to torch ops and log why."""
    from simplefsdp.kernels import triton_copy

    problem = triton_copy.interpreter_problem(triton_version="3.6.0", numpy_version="2.4.6")
    assert problem == (
        "Triton 3.6.0's interpreter cannot run under NumPy 2.4.6 (triton-lang/triton#9171): "
        "install numpy<2.4, or a newer Triton"
    )
    assert triton_copy.interpreter_problem(triton_version="3.6.0", numpy_version="2.3.5") is None
    assert triton_copy.interpreter_problem(triton_version="3.9.0", numpy_version="2.4.6") is None
    assert triton_copy.interpreter_problem(triton_version="3.10.1", numpy_version="2.10.0") is None

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SIMPLEFSDP_TRITON_ON_CPU", "1")
    importlib.reload(triton_copy)  # decorated in interpreter mode
    monkeypatch.setattr(triton_copy.triton, "__version__", "3.6.0")
    monkeypatch.setattr(pytest.importorskip("numpy"), "__version__", "2.4.0")
    assert triton_copy.supports(torch.device("cpu")) == triton_copy.interpreter_problem()
    caplog.set_level(logging.INFO, logger=LOGGER)
    _round_trip()
    (line,) = _choices(caplog)
    assert line == f"simplefsdp copy ops on cpu: torch ops; {triton_copy.interpreter_problem()}"
