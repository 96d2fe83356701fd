"""The copy kernel's launch configuration at LLM sizes, without allocating them (`kernels/launch.py`).

The plan is arithmetic on ints; these tests decode every tile the way the kernel does (the segment is
the largest one whose first tile is <= the tile; row and column tile from the local index) with
torch's int64 ops over the tile numbers (a few million) and check that the grid fits CUDA's limits and
that every destination element is written by exactly one tile. That the kernel itself follows the
plan is checked in the interpreter, bit for bit against the reference, in `test_copy_ops.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from simplefsdp.kernels import launch, reference
from tests._tiers import fast_first

VOCAB = 128_256  # Llama 3
DIMS = {"llama3-8b": 4096, "llama3-70b": 8192, "llama3-405b": 16384}


def _within_cuda_limits(plan: launch.LaunchPlan) -> None:
    x, y, z = plan.grid
    assert 1 <= x <= launch.CUDA_MAX_GRID_X
    assert max(y, z) <= launch.CUDA_MAX_GRID_YZ


def _written(plan: launch.LaunchPlan, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per segment, the destination runs its tiles write: (starts, lengths), int64, after the masks."""
    tiles = torch.arange(plan.total_tiles, dtype=torch.int64)
    starts = torch.tensor(plan.tile_starts, dtype=torch.int64)
    segment_of = torch.searchsorted(starts, tiles, right=True) - 1
    runs = []
    for i, seg in enumerate(plan.segments):
        local = tiles[segment_of == i] - plan.tile_starts[i]
        assert local.numel() == rows * seg.tiles_per_row, "each segment's tiles, once each"
        row, col_tile = local // seg.tiles_per_row, local % seg.tiles_per_row
        cols = col_tile * plan.block
        length = (seg.row_len - cols).clamp(max=plan.block)
        begin = row * seg.dst_stride + seg.dst_offset + cols
        length = torch.minimum(length, (seg.dst_limit - begin).clamp(min=0))
        runs.append((begin[length > 0], length[length > 0]))
    return runs


def _tiles_exactly(runs: list[tuple[torch.Tensor, torch.Tensor]], numel: int) -> None:
    """The runs cover [0, numel) with no gap and no overlap."""
    begin = torch.cat([b for b, _ in runs])
    length = torch.cat([n for _, n in runs])
    order = torch.argsort(begin)
    begin, end = begin[order], (begin + length)[order]
    assert (begin[0].item(), end[-1].item()) == (0, numel)
    assert torch.equal(begin[1:], end[:-1]), "no gap, no overlap"


def _shards(shapes, world):
    """Rank 0's shard sizes (the largest) and the chunks of `shapes` on `world` ranks."""
    chunks = [reference.chunk_numel(s, world) for s in shapes]
    return [min(c, math.prod(s)) for c, s in zip(chunks, shapes, strict=True)], chunks


CASES = [
    ("405B embedding on 2 ranks", [(VOCAB, DIMS["llama3-405b"])], 2),
    ("8B embedding, norm, output on 1 rank", [(VOCAB, 4096), (4096,), (VOCAB, 4096)], 1),
    ("8B embedding, norm, output on 7 ranks", [(VOCAB, 4096), (4096,), (VOCAB, 4096)], 7),
    ("70B embedding on 15 ranks", [(VOCAB, DIMS["llama3-70b"])], 15),
    ("405B embedding, norm, output on 31 ranks", [(VOCAB, 16384), (16384,), (VOCAB, 16384)], 31),
]


@pytest.mark.parametrize(("name", "shapes", "world"), fast_first(CASES, rows=True), ids=[c[0] for c in CASES])
def test_llm_buckets_launch_within_cuda_limits_and_write_every_element_once(name, shapes, world):
    src_numels, chunks = _shards(shapes, world)
    bucket = sum(chunks)
    # the first kernel's grid put a parameter's column tiles in y: over the limit for these pieces
    assert max(-(-c // launch.BLOCK) for c in chunks) > launch.CUDA_MAX_GRID_YZ

    copy_in = launch.plan_launch(kind="pack", chunks=chunks, numels=src_numels, rows=1)  # all-gather copy-in
    _within_cuda_limits(copy_in)
    _tiles_exactly(_written(copy_in, 1), bucket)

    rs_in = launch.plan_launch(kind="pack", chunks=chunks, numels=[math.prod(s) for s in shapes], rows=world)
    _within_cuda_limits(rs_in)
    _tiles_exactly(_written(rs_in, world), world * bucket)

    copy_out = launch.plan_launch(kind="unpack", chunks=chunks, numels=[math.prod(s) for s in shapes], rows=world)
    _within_cuda_limits(copy_out)
    for runs, shape in zip(_written(copy_out, world), shapes, strict=True):
        _tiles_exactly([runs], math.prod(shape))
    # int64 indices: the largest one, with a full tile past it, is far from overflowing
    assert world * bucket + launch.BLOCK < 2**63


def test_beyond_the_x_limit_the_loop_takes_the_rest():
    """A piece with more tiles than CUDA allows programs in x: the grid stays at the limit and the
    programs' strided loops (program p: tiles p, p + x, p + 2x, ...) reach every tile once."""
    chunk = (launch.CUDA_MAX_GRID_X + 5) * launch.BLOCK
    plan = launch.plan_launch(kind="pack", chunks=[chunk], numels=[chunk], rows=1)
    assert plan.grid == (launch.CUDA_MAX_GRID_X, 1, 1)
    assert plan.total_tiles == plan.grid[0] + 5  # programs 0 to 4 loop once more, to tiles p + 2^31 - 1
    small = launch.plan_launch(kind="pack", chunks=[10, 0, 7], numels=[10, 0, 3], rows=3, block=4, max_programs=2)
    seen = sorted(t for p in range(small.grid[0]) for t in range(p, small.total_tiles, small.grid[0]))
    assert seen == list(range(small.total_tiles)) == list(range(3 * (3 + 0 + 2)))


def test_empty_buckets_launch_nothing():
    assert launch.plan_launch(kind="pack", chunks=[], numels=[], rows=4).grid == (0, 1, 1)
    assert launch.plan_launch(kind="unpack", chunks=[0, 0], numels=[0, 0], rows=2).grid == (0, 1, 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        launch.plan_launch(kind="pack", chunks=[4], numels=[4], rows=1, block=0)
