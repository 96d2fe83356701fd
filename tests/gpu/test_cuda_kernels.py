"""The Triton copy kernel on a GPU, bit for bit against `kernels/reference.py` at LLM shapes.

Mirrors `tests/kernels/test_copy_ops.py` (the interpreter, small shapes) and `test_launch.py` (the
launch plan at these shapes, not run): here the compiled kernel runs, at the sizes the first kernel
could not launch (a Llama-3-8B embedding piece over 65,535 tiles in one parameter).
"""

from __future__ import annotations

import math

import pytest
import torch

import simplefsdp.kernels  # noqa: F401  (registers torch.ops.simplefsdp.*)
from simplefsdp.kernels import copy_ops, reference
from tests.gpu import CUDA_ONLY

pytestmark = CUDA_ONLY

VOCAB = 128_256
BLOCK_8B = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (14336, 4096),
            (4096,), (4096,)]  # fmt: skip
CASES = {
    "8B block, world 8": (BLOCK_8B, 8),
    "8B embedding, norm, output, world 2": ([(VOCAB, 4096), (4096,), (VOCAB, 4096)], 2),
    "odd sizes, world 3": ([(1001, 7), (5,), (33, 3)], 3),  # unaligned: the kernel without the vector hint
}


@pytest.fixture
def launches(monkeypatch):
    copy_ops._kernel_choice.cache_clear()
    from simplefsdp.kernels import triton_copy

    plans = []
    launch = triton_copy.launch_bucket
    monkeypatch.setattr(triton_copy, "launch_bucket", lambda plan, *a, **k: plans.append(plan) or launch(plan, *a, **k))
    yield plans
    copy_ops._kernel_choice.cache_clear()


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_bitwise(name, launches):
    shapes, world = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fulls = [torch.randn(s, device="cuda", generator=gen) for s in shapes]  # fp32 masters
    chunks = [reference.chunk_numel(s, world) for s in shapes]
    bf16, rank = torch.bfloat16, world - 1  # the last rank: short or empty last shards
    rows = [math.ceil(f.shape[0] / world) for f in fulls]
    shards = [f[rank * r : (rank + 1) * r].contiguous() for f, r in zip(fulls, rows, strict=True)]

    got = torch.ops.simplefsdp.all_gather_copy_in(shards, chunks, bf16)
    want = torch.cat(
        [
            torch.nn.functional.pad(s.reshape(-1).to(bf16), (0, c - s.numel()))
            for s, c in zip(shards, chunks, strict=True)
        ]
    )
    assert torch.equal(got, want)

    gathered = torch.randn(world * sum(chunks), device="cuda", generator=gen).to(bf16)
    outs = torch.ops.simplefsdp.all_gather_copy_out(
        gathered, chunks, [d for s in shapes for d in s], [len(s) for s in shapes], world
    )
    for out, expected in zip(outs, reference.all_gather_copy_out(gathered, chunks, shapes, world), strict=True):
        assert torch.equal(out, expected)
    del outs

    got = torch.ops.simplefsdp.reduce_scatter_copy_in(fulls, world, bf16, 1 / world)
    assert torch.equal(got, reference.reduce_scatter_copy_in(fulls, world, bf16, 1 / world))
    assert len(launches) == 3, "the Triton path, one launch per op"
    assert all(plan.grid[0] <= 2**31 - 1 and plan.grid[1:] == (1, 1) for plan in launches)
