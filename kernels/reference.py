"""Pure-torch references of the three bucket copy ops: the specification the kernels are tested against.

Shapes, for a bucket of parameters `i` with `numel_i` elements in full and, on `world` ranks,
`chunk_i = ceil(dim0_i / world) * (numel_i / dim0_i)` elements per rank (dim 0 padded to a
multiple of `world`, as DTensor shards it):

- `all_gather_copy_in(shards, chunks, dtype)`: this rank's all-gather slot `[sum(chunks)]`: its
  shards (each at most `chunk_i` elements, fewer on ranks holding a short last shard), cast to
  `dtype`, zero-padded to `chunk_i`, concatenated. The all-gather sends it; where it lands in the
  gathered buffer is the collective's business (no rank here).
- `all_gather_copy_out(gathered, chunks, shapes, world)`: `[world * sum(chunks)]` (rank slots in
  order) -> each parameter's full value in `shapes[i]` (padding stripped; the op takes the shapes
  flattened, see `copy_ops.split_shapes`).
- `reduce_scatter_copy_in(grads, world, dtype, scale)`: full gradients (flat `[numel_i]`) -> cast to
  `dtype` (times `scale`, multiplied in fp32), each zero-padded to `world * chunk_i` and its rank chunks interleaved:
  `[world * sum(chunks)]`, rank r's slot holding every gradient's chunk r (`torch._chunk_cat`'s layout).
  This rank's reduced slot is then `[sum(chunks)]`, each shard gradient a contiguous run of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "cast",
    "chunk_numel",
    "reduce_scatter_copy_in",
]


def chunk_numel(shape: Sequence[int], world: int) -> int:
    """Elements of one rank's (padded) dim-0 shard of a tensor of `shape` on `world` ranks."""
    if not shape:
        return 1  # a scalar is not sharded: every rank holds all of it
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def cast(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A new tensor: `x` in `dtype`; a `scale` other than 1 multiplies in fp32 first (one rounding)."""
    return x.to(dtype, copy=True) if scale == 1.0 else (x.float() * scale).to(dtype)


def all_gather_copy_in(shards: Sequence[torch.Tensor], chunks: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    pieces = [F.pad(s.reshape(-1).to(dtype), (0, c - s.numel())) for s, c in zip(shards, chunks, strict=True)]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)


def all_gather_copy_out(
    gathered: torch.Tensor, chunks: Sequence[int], shapes: Sequence[Sequence[int]], world: int
) -> list[torch.Tensor]:
    per_rank = gathered.view(world, -1).split(list(chunks), dim=1)
    return [
        piece.reshape(-1)[: math.prod(shape)].clone().view(list(shape))
        for piece, shape in zip(per_rank, shapes, strict=True)
    ]


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], world: int, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    rows = []
    for g in grads:
        chunk = chunk_numel(g.shape, world)
        padded = F.pad(cast(g.reshape(-1), dtype, scale), (0, world * chunk - g.numel()))
        rows.append(padded.view(world, chunk))
    return torch.cat(rows, dim=1).reshape(-1) if rows else torch.empty(0, dtype=dtype)
