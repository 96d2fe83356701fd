"""One Triton kernel behind the three bucket copy ops: a strided, masked, casting row copy.

Every op moves, for each parameter `i` of a bucket, `rows` rows of `chunk_i` elements between a
per-parameter flat tensor and a flat bucket buffer whose rows are `bucket` elements long:

    pack   (copy-in):  dst[r * bucket + offset_i + j] = cast(src_i[r * chunk_i + j])   (0 past src_i's end)
    unpack (copy-out): dst_i[r * chunk_i + j]        = src[r * bucket + offset_i + j]  (dropped past dst_i's end)

with `rows = world` for the reduce-scatter copy-in and the all-gather copy-out and `rows = 1` for
the all-gather copy-in. Each element is read once and written once; casts happen in registers.

[Note: exact bf16 rounding] Every value written as bf16 is rounded to nearest-even with integer bit
arithmetic (add 0x7FFF plus the kept lowest bit, drop 16 bits; NaNs stay NaN), so the result equals
torch's `.to(torch.bfloat16)` both on a GPU and in the CPU interpreter. The interpreter's own
fp32 -> bf16 cast does not round like torch (on torch 2.13 with Triton 3.x, about half of random
values came out 1 ulp off, also with `fp_downcast_rounding="rtne"`); a GPU's cast does. Other
down-casts (to fp16) use Triton's cast: exact on a GPU, within 1 ulp in the interpreter -- the
tests say so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pack", "unpack"]

_BLOCK = 1024


@triton.jit
def _to_bf16_rtne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = x != x
    rounded = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _row_copy_kernel(
    src,
    dst,
    src_row_stride,
    src_offset,
    src_limit,
    dst_row_stride,
    dst_offset,
    dst_limit,
    row_len,
    scale,
    HAS_SCALE: tl.constexpr,
    DST_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < row_len
    src_index = row * src_row_stride + src_offset + cols
    dst_index = row * dst_row_stride + dst_offset + cols
    store = in_row & (dst_index < dst_limit)
    x = tl.load(src + src_index, mask=in_row & (src_index < src_limit), other=0.0)
    if HAS_SCALE:
        x = x.to(tl.float32) * scale
    if DST_BF16:
        y = _to_bf16_rtne(x.to(tl.float32))
    else:
        y = x.to(dst.dtype.element_ty)
    tl.store(dst + dst_index, y, mask=store)


def _launch(src, dst, *, rows, src_stride, src_offset, src_limit, dst_stride, dst_offset, dst_limit, row_len, scale):
    if rows == 0 or row_len == 0:
        return
    grid = (rows, triton.cdiv(row_len, _BLOCK))
    _row_copy_kernel[grid](
        src,
        dst,
        src_stride,
        src_offset,
        src_limit,
        dst_stride,
        dst_offset,
        dst_limit,
        row_len,
        float(scale),
        HAS_SCALE=scale != 1.0,
        DST_BF16=dst.dtype == torch.bfloat16,
        BLOCK=_BLOCK,
    )


def pack(srcs: list[torch.Tensor], chunks: list[int], out: torch.Tensor, *, rows: int, scale: float = 1.0) -> None:
    """`out` (flat, `rows * sum(chunks)`) <- each flat contiguous `srcs[i]` split into `rows` chunks."""
    bucket, offset = sum(chunks), 0
    for src, chunk in zip(srcs, chunks, strict=True):
        _launch(src, out, rows=rows, src_stride=chunk, src_offset=0, src_limit=src.numel(), dst_stride=bucket,
                dst_offset=offset, dst_limit=out.numel(), row_len=chunk, scale=scale)  # fmt: skip
        offset += chunk


def unpack(src: torch.Tensor, chunks: list[int], outs: list[torch.Tensor], *, rows: int) -> None:
    """Each flat contiguous `outs[i]` <- its `rows` chunks of the flat bucket buffer `src` (the inverse of `pack`)."""
    bucket, offset = sum(chunks), 0
    for out, chunk in zip(outs, chunks, strict=True):
        _launch(src, out, rows=rows, src_stride=bucket, src_offset=offset, src_limit=src.numel(), dst_stride=chunk,
                dst_offset=0, dst_limit=out.numel(), row_len=chunk, scale=1.0)  # fmt: skip
        offset += chunk
