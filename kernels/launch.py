"""The launch configuration of the bucket copy kernel: a pure function of the bucket's sizes.

One launch copies a whole bucket. The work is cut into *tiles* of `block` elements, each tile inside
one row of one segment (a parameter's `chunk`-element run in one of the `rows` rank slots), so a tile
never straddles two parameters or two rows. Tiles are numbered segment by segment, row by row:

    segment i owns tiles [tile_starts[i], tile_starts[i + 1]), rows * cdiv(chunk_i, block) of them;
    its local tile t is row t // tiles_per_row_i, columns [(t % tiles_per_row_i) * block, ... + block)

The grid is one-dimensional: `min(total_tiles, max_programs)` programs, program p handling tiles
p, p + programs, p + 2 * programs, ... (a loop inside the kernel). The kernel finds a tile's segment
by binary search over `tile_starts` (the largest i with tile_starts[i] <= tile).

[Note: grid limits]
CUDA caps a grid at 2^31 - 1 programs in dimension x and 65,535 in y and z. The previous kernel put
the column tiles of one parameter in y: any parameter piece over 65,535 * 1024 = 67.1M elements (the
Llama-3-8B embedding sharded over 7 ranks or fewer) could not launch, and the CPU interpreter, which
checks no limit, could not show it. Here y and z are always 1 and x is capped at `max_programs`
(CUDA's x limit by default), the in-kernel loop covering any tiles beyond it, so no size fails to
launch. Everything here is arithmetic on Python ints: the tests check the limits and the
exactly-once coverage at LLM sizes without allocating a byte of them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCK",
    "CUDA_MAX_GRID_X",
    "CUDA_MAX_GRID_YZ",
    "LaunchPlan",
    "Segment",
    "plan_launch",
]

CUDA_MAX_GRID_X = 2**31 - 1
CUDA_MAX_GRID_YZ = 65_535
# Elements per tile (1024, 4 warps: 8 elements a thread). Measured on an H200 for one 8B block's
# copy-in at world 8 (27 M elements, back to back): 45.0 us at 1024 / 4 warps, 43.6-44.2 us for 2048,
# 4096 and 8192 with 4 or 8 warps, 62.6 us at 1024 / 8 warps -- within 3% of the best, so kept.
BLOCK = 1024


@dataclass(frozen=True)
class Segment:
    """One parameter's copy: `rows` rows of `row_len` elements, row r read from
    `src[r * src_stride + src_offset + j]` (0 at or past `src_limit`) and written to
    `dst[r * dst_stride + dst_offset + j]` (dropped at or past `dst_limit`), indices relative to the
    segment's own source and destination tensors."""

    row_len: int
    src_stride: int
    src_offset: int
    src_limit: int
    dst_stride: int
    dst_offset: int
    dst_limit: int
    tiles_per_row: int


@dataclass(frozen=True)
class LaunchPlan:
    """`grid` (1-D, within CUDA's limits; `(0,)`: nothing to launch), the tile numbering
    `tile_starts` (len(segments) + 1 entries, non-decreasing, from 0 to `total_tiles`) and the
    segments in bucket order."""

    grid: tuple[int, int, int]
    block: int
    tile_starts: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def total_tiles(self) -> int:
        return self.tile_starts[-1]


def plan_launch(
    *,
    kind: Literal["pack", "unpack"],
    chunks: Sequence[int],
    numels: Sequence[int],
    rows: int,
    block: int = BLOCK,
    max_programs: int = CUDA_MAX_GRID_X,
) -> LaunchPlan:
    """The launch of one bucket copy between per-parameter flat tensors (`numels[i]` elements) and a
    flat `[rows, sum(chunks)]` bucket buffer, parameter i at column offset `sum(chunks[:i])`:

    - `"pack"` (copy-in): source i split into `rows` runs of `chunks[i]`, each written to its row
      of the buffer; past a source's end the buffer gets zeros;
    - `"unpack"` (copy-out, the inverse): output i (`numels[i] <= rows * chunks[i]`) gets its
      `rows` runs from the buffer; the padding past an output's end is not written.

    Either way every element of the destination(s) is written exactly once. Plans are cached (the
    same bucket is copied every step; a plan is frozen, so sharing one is safe): planning cost ~17 us
    of host time a call, as much as the kernel launch."""
    return _plan(kind, tuple(chunks), tuple(numels), rows, block, max_programs)


@functools.lru_cache(maxsize=1024)
def _plan(
    kind: str, chunks: tuple[int, ...], numels: tuple[int, ...], rows: int, block: int, max_programs: int
) -> LaunchPlan:
    if block < 1 or max_programs < 1 or rows < 0 or kind not in ("pack", "unpack"):
        raise ValueError(f"block {block}, max_programs {max_programs} must be >= 1, rows {rows} >= 0, kind {kind!r}")
    bucket, offset, segments = sum(chunks), 0, []
    for chunk, numel in zip(chunks, numels, strict=True):
        flat = (chunk, 0, numel)  # (stride, offset, limit) of the per-parameter tensor
        buffer = (bucket, offset, rows * bucket)  # ... and of the bucket buffer
        ends = (*flat, *buffer) if kind == "pack" else (*buffer, *flat)
        segments.append(Segment(chunk, *ends, tiles_per_row=-(-chunk // block)))
        offset += chunk
    tile_starts = tuple(itertools.accumulate((rows * s.tiles_per_row for s in segments), initial=0))
    programs = min(tile_starts[-1], max_programs, CUDA_MAX_GRID_X)
    return LaunchPlan(grid=(programs, 1, 1), block=block, tile_starts=tile_starts, segments=tuple(segments))
