"""Block-scaled quantization of sharded parameters for the all-gather: the specification, in torch ops.

A quantized gather sends, for each parameter of a bucket, this rank's shard as one-byte codes with one
fp32 scale per block of `block` elements, and every rank dequantizes the gathered codes straight into
the compute dtype. This module defines the bytes exactly; the copy ops (`quant_ops.py`) run it through
these torch ops on the CPU and through Triton kernels elsewhere, and the two agree bit for bit.

The slot (what one rank contributes; `slot_layout`): the codes of every member, back to back, member i
at byte `code_offsets[i]` (`chunks[i]` bytes: its padded shard, one byte an element), then zeros up to
the next multiple of 16 bytes (`scales_start`), then every member's scales as fp32, member i's at
float `scale_offsets[i]` of that section (`blocks(chunks[i])` of them), then zeros to a multiple of
16 bytes (`nbytes`). Blocks start at each member's chunk: a block never holds two parameters. The
padding of a short shard (zeros) can share a block with its last elements, which it cannot change:
a zero moves no absmax and decodes to zero.

One block `x` (fp32: the master's values, exactly; padding zeros) becomes, with `QMAX` = 127 (int8)
or 448 (float8_e4m3fn, its largest finite value):

    absmax = max |x|;   scale = absmax / QMAX  (IEEE division)
    lift = 2**64 when absmax < 2**-64, else 1   (exact: a power of two)
    y = (x * lift) * (QMAX / (absmax * lift)), clamped to [-QMAX, QMAX]   (0 when absmax is 0)
    int8:  code = round-half-even(y) as a two's-complement byte
    fp8:   code = y rounded to nearest-even e4m3fn (integer bit arithmetic, below)

and decodes to `float(code) * scale`, cast to the output dtype (bf16: nearest-even, as torch rounds).

[Note: quantized gathers]
Why block scales and where the error lands: a block's values are known to within half a code step,
`absmax / 254` for int8 (plus a few fp32 roundings, far below it: the tests allow `absmax * 2**-20`)
and, for e4m3fn, half a unit in the last place (relative 2**-4 of the value; 2**-10 of the scale in
the subnormal range). ZeRO++ gathers int8 weights with per-block scales for the same reason: one
outlier only coarsens its own block.

The `lift` keeps `QMAX / absmax` finite: without it a block whose absmax is below QMAX / 2**128
(about 3.7e-37 for int8, normal fp32 values) gets an infinite inverse, its nonzero values encode as
+-QMAX and its zeros as `0 * inf`, nan -- a wrong value, not a coarse one. Scaling the block and its
absmax by the same power of two changes no bit elsewhere (both products are exact and the final
product the same real number), and below 2**-64 every quotient stays finite. What remains for tiny
blocks is the fp32 scale's own underflow: below about QMAX * 2**-126 the scale is subnormal and
carries an absolute error up to 2**-150, so a value decodes within a further QMAX * 2**-150 (< 2**-140).

A block holding an inf or a nan has no meaningful scale: its scale is nan and its codes 0, so every
element of the block decodes to nan -- never to a finite wrong value, and the loss shows it at once.

Every step is integer arithmetic or a correctly rounded fp32 operation (multiply, IEEE division,
the add-and-subtract of 1.5 * 2**23 that rounds half to even), so a GPU kernel, Triton's CPU
interpreter (whose own float casts do not round like torch's) and these ops compute the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from simplefsdp._compat import foreach_copy_

__all__ = [
    "CODE_DTYPES",
    "QMAX",
    "SlotLayout",
    "decode",
    "dequantize_gathered",
    "encode",
    "quantize_slot",
    "slot_layout",
]

# the code types a gather may use, and the largest magnitude each encodes
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds an fp32 |y| < 2**22 half to even
TINY, LIFT = 2.0**-64, 2.0**64  # a block with absmax < TINY is scaled by LIFT first (module docstring)
ALIGN = 16  # bytes: where the scale section and each rank's slot start


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one rank's slot for a bucket of `chunks` (elements per member) in blocks of `block`."""

    chunks: tuple[int, ...]
    block: int
    code_offsets: tuple[int, ...]  # bytes, from the slot's start
    scale_offsets: tuple[int, ...]  # fp32 elements, from `scales_start`
    scales_start: int  # bytes, a multiple of ALIGN
    nbytes: int  # the slot's size in bytes, a multiple of ALIGN

    def blocks(self, i: int) -> int:
        """Blocks (so scales) of member `i`."""
        return -(-self.chunks[i] // self.block)

    @property
    def n_scales(self) -> int:
        return sum(self.blocks(i) for i in range(len(self.chunks)))


@functools.lru_cache(maxsize=1024)
def _layout(chunks: tuple[int, ...], block: int) -> SlotLayout:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if any(c < 0 for c in chunks):
        raise ValueError(f"chunks must be >= 0, got {list(chunks)}")
    code_offsets, scale_offsets, codes, scales = [], [], 0, 0
    for chunk in chunks:
        code_offsets.append(codes)
        scale_offsets.append(scales)
        codes += chunk
        scales += -(-chunk // block)
    scales_start = _round_up(codes, ALIGN)
    nbytes = _round_up(scales_start + 4 * scales, ALIGN)
    return SlotLayout(chunks, block, tuple(code_offsets), tuple(scale_offsets), scales_start, nbytes)


def slot_layout(chunks: Sequence[int], block: int) -> SlotLayout:
    """The slot layout (module docstring) of a bucket whose members have `chunks` elements per rank."""
    return _layout(tuple(int(c) for c in chunks), int(block))


def encode(y: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes of fp32 `y` (finite, |y| <= QMAX[code_dtype]): int8 round-half-even, or e4m3fn
    round-to-nearest-even from the fp32 bits (a normal keeps 3 of 23 mantissa bits; below 2**-6 the
    subnormal step is 2**-9)."""
    if code_dtype == torch.int8:
        q = (y + ROUND_MAGIC) - ROUND_MAGIC
        return q.to(torch.int32).bitwise_and(0xFF).to(torch.uint8)
    bits = y.view(torch.int32)
    sign = (bits < 0).to(torch.int32) * 128
    a = bits.bitwise_and(0x7FFFFFFF)
    exponent = a >> 23
    mantissa = a.bitwise_and(0x7FFFFF)
    keep = mantissa >> 20
    rest = mantissa.bitwise_and(0xFFFFF)
    up = (rest > 0x80000) | ((rest == 0x80000) & (keep.bitwise_and(1) == 1))
    normal = ((exponent - 120) << 3) + keep + up.to(torch.int32)
    subnormal = ((a.view(torch.float32) * 512.0 + ROUND_MAGIC) - ROUND_MAGIC).to(torch.int32)
    code = torch.where(exponent >= 121, normal, subnormal) + sign
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of uint8 `codes` (exact: every code is an fp32 value)."""
    if code_dtype == torch.int8:
        return codes.view(torch.int8).to(torch.float32)
    c = codes.to(torch.int32)
    exponent = (c >> 3).bitwise_and(0xF)
    mantissa = c.bitwise_and(7)
    normal = (((exponent + 120) << 23) + (mantissa << 20)).view(torch.float32)
    value = torch.where(exponent > 0, normal, mantissa.to(torch.float32) * 0.001953125)
    return torch.where(c >= 128, -value, value)


def _quantize_blocks(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, x's shape) and scales (fp32, one per row) of fp32 `x` [blocks, block], which
    it may overwrite. Fewer passes over memory than the module docstring's steps, the same bytes:
    `torch.round` rounds half to even as the magic add does for |y| <= QMAX; torch's e4m3fn cast is
    `encode`'s rounding (tested), and neither needs the clamp: |x * (QMAX / absmax)| rounds to at
    most QMAX; the lift multiplies only when a block needs it."""
    qmax = QMAX[code_dtype]
    absmax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])  # nan propagates: a nan block
    bad = ~torch.isfinite(absmax)
    absmax = absmax.masked_fill(bad, 0.0)
    lift = torch.where(absmax < TINY, LIFT, 1.0)
    # tensor / tensor, the IEEE quotient: torch computes `scalar / tensor` as the scalar times the
    # reciprocal (two roundings: a quarter of quotients 1 ulp off), and on CUDA `tensor / scalar` too
    qmaxes = torch.full_like(absmax, qmax)
    positive = absmax > 0
    inverse = torch.where(positive, qmaxes / torch.where(positive, absmax * lift, 1.0), 0.0)
    if bool(bad.any()):
        x = x.masked_fill(bad[:, None], 0.0)
    lifted = positive & (absmax < TINY)
    if bool(lifted.any()):
        x = x.mul_(lift[:, None])
    y = x.mul_(inverse[:, None])
    if code_dtype == torch.int8:
        codes = y.round_().to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(code_dtype).view(torch.uint8)
    return codes, torch.where(bad, float("nan"), absmax / qmaxes)


def _staged(shards: Sequence[torch.Tensor], layout: SlotLayout) -> torch.Tensor:
    """fp32 `[blocks, block]`: every shard's values from its first block on, zeros after its end."""
    counts = [layout.blocks(i) * layout.block for i in range(len(layout.chunks))]
    device = shards[0].device if shards else torch.device("cpu")
    staged = torch.zeros(sum(counts), dtype=torch.float32, device=device)
    places = [p[: s.numel()] for p, s in zip(staged.split(counts), shards, strict=True) if s.numel()]
    if places:
        foreach_copy_(places, [s.reshape(-1) for s in shards if s.numel()])
    return staged.view(-1, layout.block)


@torch.no_grad()
def quantize_slot(
    shards: Sequence[torch.Tensor], chunks: Sequence[int], code_dtype: torch.dtype, block: int
) -> torch.Tensor:
    """One rank's slot (uint8, `slot_layout(chunks, block).nbytes`) for `shards` (any float dtype,
    any shape; read in logical order, at most `chunks[i]` elements each)."""
    layout = slot_layout(chunks, block)
    device = shards[0].device if shards else torch.device("cpu")
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    if not layout.n_scales:
        return slot
    codes, scales = _quantize_blocks(_staged(shards, layout), code_dtype)
    codes = codes.view(-1)
    starts = [sum(layout.blocks(j) for j in range(i)) * block for i in range(len(layout.chunks))]
    pieces = [codes[start : start + chunk] for start, chunk in zip(starts, layout.chunks, strict=True) if chunk]
    torch.cat(pieces, out=slot[: sum(layout.chunks)])
    slot[layout.scales_start : layout.scales_start + 4 * layout.n_scales].view(torch.float32).copy_(scales)
    return slot


@torch.no_grad()
def dequantize_gathered(
    gathered: torch.Tensor,
    chunks: Sequence[int],
    numels: Sequence[int],
    world: int,
    code_dtype: torch.dtype,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each member's full flat value (`numels[i]` elements, in `dtype`) from the gathered buffer
    (uint8, `world` slots back to back)."""
    layout = slot_layout(chunks, block)
    rows = gathered.view(world, layout.nbytes)
    scale_bytes = rows[:, layout.scales_start : layout.scales_start + 4 * layout.n_scales].contiguous()
    scales = scale_bytes.reshape(-1).view(torch.float32).view(world, layout.n_scales)  # (a 2-D view fails when empty)
    padded = [layout.blocks(i) * block for i in range(len(layout.chunks))]
    if list(layout.chunks) == padded:  # every member a whole number of blocks: the codes as they came
        codes = rows[:, : sum(padded)]
    else:
        codes = rows.new_zeros(world, sum(padded))
        for place, offset, chunk in zip(codes.split(padded, dim=1), layout.code_offsets, layout.chunks, strict=True):
            place[:, :chunk].copy_(rows[:, offset : offset + chunk])
    # torch's own cast of the codes: `decode`'s values for every code the encoder writes (tested)
    values = codes.contiguous().view(code_dtype).to(torch.float32)
    values = values.view(world, layout.n_scales, block).mul_(scales[:, :, None])
    values = values.to(dtype).view(world, -1)
    outs = []
    for piece, chunk, numel in zip(values.split(padded, dim=1), layout.chunks, numels, strict=True):
        out = piece.new_empty(world, chunk)
        out.copy_(piece[:, :chunk])
        outs.append(out.view(-1)[:numel])
    return outs
