"""Triton kernels of the quantized gather's two copies: quantize a bucket into its slot, dequantize it out.

The bytes are `quantize.py`'s, bit for bit (that module is the specification; the tests compare the
two on the whole slot and on every output value):

    quantize_into (copy-in):    slot <- every member's shard, zero past its end up to its chunk, as
                                codes + one fp32 scale per block, at `slot_layout`'s offsets; the
                                slot's padding bytes zero
    dequantize_into (copy-out): out_i[r * chunk_i + j] <- decode(code) * scale, narrowed to the
                                output dtype, for every rank row r (dropped past out_i's end)

[Note: quantized copies: one launch per bucket]
Each copy is one launch over the whole bucket, through a table like the plain copy kernel's
([Note: one launch per bucket: a table of segments] in `triton_copy.py`; the same device-table
cache, the same binary search from a tile to its member). A tile is `GROUP` whole blocks of one
member (in one rank row for the copy-out), `GROUP * block` = `max(block, TILE)` elements, held as a
`[GROUP, block]` array so a block's absmax is one row reduction in registers: a block is never split
between programs, and no second pass or atomic is needed. The copy-in table has a header
`[members, tiles, codes end, scales start, scales end, slot bytes]` (program 0 zeroes the two
padding gaps of the slot, under 16 bytes each) and a row per member `[first tile, blocks, source
pointer, source dtype code, numel, chunk, code offset, scale offset]`; the copy-out's header is
`[members, tiles, slot bytes, scales start]` and its rows `[first tile, tiles per rank row, blocks,
output pointer, numel, chunk, code offset, scale offset]`.

What it costs: every source element is read once (2 or 4 bytes) and written once as one byte, plus
4 bytes of scale per block (3% at block 128); the copy-out reads one byte and a scale per `block`
elements and writes the output dtype. Per element the copy-in does an abs, a max, two multiplies,
a clamp and the integer encode (a few dozen integer ops for e4m3fn); per block two IEEE divisions.
That is far below a GPU's arithmetic per byte of bandwidth, so the copies should be memory-bound
like the plain ones -- not measured here (no GPU was at hand; `bench/copy_kernels.py` measures it).
The tile size and warps are the plain kernel's defaults, not tuned for these kernels.

Exactness: every operation is integer arithmetic, an exact fp32 operation, or a correctly rounded
one. Division is `tl.math.div_rn` (IEEE, round to nearest), because Triton's `/` on fp32 may lower
to an approximate division on a GPU. No multiply feeds an add where a fused multiply-add could
change the result (the one product that does, `a * 512` in the e4m3fn subnormal encode, is exact), and
the kernels launch with `enable_fp_fusion=False` besides. A nan scale is written as its bits
(0x7FC00000, as torch writes `float("nan")`), not through a float constant whose payload a
compiler may choose. bf16 outputs round with `triton_copy`'s integer rounding; fp16 outputs use
Triton's cast, exact on a GPU and within 1 ulp in the CPU interpreter (the tests check which).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from simplefsdp.kernels import launch, quantize
from simplefsdp.kernels.triton_copy import (
    _TL_DTYPES,
    DTYPE_CODES,
    _device_table,
    _find_segment,
    _load_fp32,
    _narrow,
    _pointer,
)

__all__ = ["TILE", "dequantize_into", "quantize_into"]

TILE = 1024  # elements a program handles at a time (whole blocks: max(block, TILE)); the plain kernel's `BLOCK`
_IN_HEADER, _IN_FIELDS = 6, 8
_OUT_HEADER, _OUT_FIELDS = 4, 8
_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # torch's fp32 float("nan"): a non-finite block's scale
_TINY: tl.constexpr = tl.constexpr(quantize.TINY)
_LIFT: tl.constexpr = tl.constexpr(quantize.LIFT)


def _no_alignment(values: list[int]) -> int:
    """The quantized tables' summary for `triton_copy._device_table`: no alignment is claimed."""
    return 1


@triton.jit
def _encode(y, FP8: tl.constexpr):
    """uint8 codes of fp32 `y` (finite, within +-QMAX): `quantize.encode`, with the same integer steps."""
    if FP8:
        bits = y.to(tl.int32, bitcast=True)
        sign = tl.where(bits < 0, 128, 0)
        a = bits & 0x7FFFFFFF
        exponent = a >> 23
        mantissa = a & 0x7FFFFF
        keep = mantissa >> 20
        rest = mantissa & 0xFFFFF
        up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
        normal = ((exponent - 120) << 3) + keep + up.to(tl.int32)
        subnormal = ((a.to(tl.float32, bitcast=True) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
        code = tl.where(exponent >= 121, normal, subnormal) + sign
    else:
        code = ((y + 12582912.0) - 12582912.0).to(tl.int32) & 0xFF
    return code.to(tl.uint8)


@triton.jit
def _decode(codes, FP8: tl.constexpr):
    """fp32 values of uint8 `codes`: `quantize.decode` (exact)."""
    if FP8:
        c = codes.to(tl.int32)
        exponent = (c >> 3) & 0xF
        mantissa = c & 7
        normal = (((exponent + 120) << 23) + (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.001953125)
        value = tl.where(c >= 128, -value, value)
    else:
        value = codes.to(tl.int8, bitcast=True).to(tl.float32)
    return value


@triton.jit
def _quantize_blocks(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """Codes (uint8, x's shape) and scale bits (int32, one per row) of fp32 `x` [GROUP, block].

    Row maxima are `tl.reduce` with the standard library's max combine function, which is what
    `tl.max` runs, without calling `tl.max` itself: the standard library's functions are decorated
    when Triton is first imported, so in a process that imported it before turning the interpreter
    on (a test session) `tl.max` cannot run in the interpreter; the interpreter recognizes the
    combine function and reduces with NumPy (any other combine function runs element by element in
    Python, some hundred times slower)."""
    bad = tl.reduce(((x - x) != 0).to(tl.int32), 1, tl.standard._elementwise_max) > 0  # an inf or nan in the block
    absmax = tl.where(bad, 0.0, tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max))
    lift = tl.where(absmax < _TINY, _LIFT, 1.0)
    positive = absmax > 0
    inverse = tl.where(positive, tl.math.div_rn(tl.full(absmax.shape, QMAX, tl.float32),
                                                tl.where(positive, absmax * lift, 1.0)), 0.0)  # fmt: skip
    y = tl.where(bad[:, None], 0.0, (x * lift[:, None]) * inverse[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    return _encode(y, FP8), tl.where(bad, _NAN_BITS, scale.to(tl.int32, bitcast=True))


@triton.jit
def _quant_copy_in_kernel(
    table,
    slot,
    QMAX: tl.constexpr,
    FP8: tl.constexpr,
    QBLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    HEADER: tl.constexpr,
    FIELDS: tl.constexpr,
):
    n_members = tl.load(table)
    total_tiles = tl.load(table + 1)
    scales = (slot + tl.load(table + 3)).to(tl.pointer_type(tl.int32))
    if tl.program_id(0) == 0:  # the slot's two padding gaps, each under quantize.ALIGN bytes
        gap = tl.arange(0, 16)
        zeros = tl.full([16], 0, tl.uint8)  # (not tl.zeros: see _quantize_blocks on the standard library)
        codes_end, scales_start = tl.load(table + 2), tl.load(table + 3)
        scales_end, nbytes = tl.load(table + 4), tl.load(table + 5)
        tl.store(slot + codes_end + gap, zeros, mask=codes_end + gap < scales_start)
        tl.store(slot + scales_end + gap, zeros, mask=scales_end + gap < nbytes)
    for tile in range(tl.program_id(0).to(tl.int64), total_tiles, tl.num_programs(0).to(tl.int64)):
        row = table + HEADER + _find_segment(table, n_members, tile, HEADER, FIELDS) * FIELDS
        blocks = (tile - tl.load(row)) * GROUP + tl.arange(0, GROUP)  # [GROUP] this member's block numbers
        index = blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # [GROUP, QBLOCK] its elements
        x = _load_fp32(tl.load(row + 2), tl.load(row + 3), index, index < tl.load(row + 4), 1)
        codes, scale_bits = _quantize_blocks(x, QMAX, FP8)
        tl.store(slot + tl.load(row + 6) + index, codes, mask=index < tl.load(row + 5))
        tl.store(scales + tl.load(row + 7) + blocks, scale_bits, mask=blocks < tl.load(row + 1))


@triton.jit
def _quant_copy_out_kernel(
    table,
    gathered,
    FP8: tl.constexpr,
    DST: tl.constexpr,
    DST_CODE: tl.constexpr,
    QBLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    HEADER: tl.constexpr,
    FIELDS: tl.constexpr,
):
    n_members = tl.load(table)
    total_tiles = tl.load(table + 1)
    nbytes, scales_start = tl.load(table + 2), tl.load(table + 3)
    for tile in range(tl.program_id(0).to(tl.int64), total_tiles, tl.num_programs(0).to(tl.int64)):
        row = table + HEADER + _find_segment(table, n_members, tile, HEADER, FIELDS) * FIELDS
        local = tile - tl.load(row)
        tiles_per_row = tl.load(row + 1)
        r = local // tiles_per_row  # the rank row
        blocks = (local - r * tiles_per_row) * GROUP + tl.arange(0, GROUP)
        index = blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        chunk, numel = tl.load(row + 5), tl.load(row + 4)
        rank_slot = gathered + r * nbytes
        codes = tl.load(rank_slot + tl.load(row + 6) + index, mask=index < chunk, other=0)
        scales = (rank_slot + scales_start).to(tl.pointer_type(tl.float32))
        scale = tl.load(scales + tl.load(row + 7) + blocks, mask=blocks < tl.load(row + 2), other=0.0)
        value = _narrow(_decode(codes, FP8) * scale[:, None], DST, DST_CODE)
        out = r * chunk + index
        tl.store(_pointer(tl.load(row + 3), DST, 1) + out, value, mask=(index < chunk) & (out < numel))


def _group(block: int) -> int:
    return max(1, TILE // block)


def _grid(total_tiles: int) -> tuple[int]:
    return (min(total_tiles, launch.CUDA_MAX_GRID_X),)


def _in_table(layout: quantize.SlotLayout, srcs: list[torch.Tensor]) -> list[int]:
    group, tile, rows = _group(layout.block), 0, []
    for i, src in enumerate(srcs):
        blocks = layout.blocks(i)
        rows += [tile, blocks, src.data_ptr(), DTYPE_CODES[src.dtype], src.numel(), layout.chunks[i]]
        rows += [layout.code_offsets[i], layout.scale_offsets[i]]
        tile += -(-blocks // group)
    scales_end = layout.scales_start + 4 * layout.n_scales
    return [len(srcs), tile, sum(layout.chunks), layout.scales_start, scales_end, layout.nbytes, *rows]


def _out_table(layout: quantize.SlotLayout, outs: list[torch.Tensor], world: int) -> list[int]:
    group, tile, rows = _group(layout.block), 0, []
    for i, out in enumerate(outs):
        blocks = layout.blocks(i)
        per_row = -(-blocks // group)
        rows += [tile, per_row, blocks, out.data_ptr(), out.numel(), layout.chunks[i]]
        rows += [layout.code_offsets[i], layout.scale_offsets[i]]
        tile += world * per_row
    return [len(outs), tile, layout.nbytes, layout.scales_start, *rows]


def _check(what: str, tensors: list[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}[{i}]: on {t.device} (launch on {device}), contiguous={t.is_contiguous()}")


def quantize_into(
    srcs: list[torch.Tensor], layout: quantize.SlotLayout, slot: torch.Tensor, code_dtype: torch.dtype
) -> None:
    """`slot` (uint8, `layout.nbytes`, 16-byte aligned) <- `quantize.quantize_slot` of the flat
    contiguous `srcs` (`srcs[i].numel() <= layout.chunks[i]`): one launch, none for an empty slot."""
    _check("srcs", [*srcs, slot], slot.device)
    if slot.numel() != layout.nbytes or slot.dtype != torch.uint8 or slot.data_ptr() % quantize.ALIGN:
        raise ValueError(f"slot: {slot.dtype} [{slot.numel()}] at {slot.data_ptr():#x}; uint8 [{layout.nbytes}], "
                         f"{quantize.ALIGN}-byte aligned expected")  # fmt: skip
    values = _in_table(layout, srcs)
    if values[1] == 0:
        return  # no blocks: the slot has no bytes either
    table, _ = _device_table(values, slot.device, _no_alignment)
    _quant_copy_in_kernel[_grid(values[1])](
        table,
        slot,
        QMAX=quantize.QMAX[code_dtype],
        FP8=code_dtype == torch.float8_e4m3fn,
        QBLOCK=layout.block,
        GROUP=_group(layout.block),
        HEADER=_IN_HEADER,
        FIELDS=_IN_FIELDS,
        enable_fp_fusion=False,
    )


def dequantize_into(
    gathered: torch.Tensor, layout: quantize.SlotLayout, outs: list[torch.Tensor], world: int, code_dtype: torch.dtype
) -> None:
    """Each flat contiguous `outs[i]` (one dtype) <- `quantize.dequantize_gathered` of the `world`
    slots of `gathered` (uint8, contiguous, 16-byte aligned): one launch, none for empty outputs."""
    _check("outs", [*outs, gathered], gathered.device)
    if gathered.numel() != world * layout.nbytes or gathered.data_ptr() % quantize.ALIGN:
        raise ValueError(f"gathered: [{gathered.numel()}] at {gathered.data_ptr():#x}; [{world} x {layout.nbytes}], "
                         f"{quantize.ALIGN}-byte aligned expected")  # fmt: skip
    if not outs or any(o.dtype != outs[0].dtype for o in outs):
        raise ValueError(f"outs share one dtype; got {sorted({str(o.dtype) for o in outs})}")
    values = _out_table(layout, outs, world)
    if values[1] == 0:
        return
    table, _ = _device_table(values, gathered.device, _no_alignment)
    dtype = outs[0].dtype
    _quant_copy_out_kernel[_grid(values[1])](
        table,
        gathered,
        FP8=code_dtype == torch.float8_e4m3fn,
        DST=_TL_DTYPES[dtype],
        DST_CODE=DTYPE_CODES[dtype],
        QBLOCK=layout.block,
        GROUP=_group(layout.block),
        HEADER=_OUT_HEADER,
        FIELDS=_OUT_FIELDS,
        enable_fp_fusion=False,
    )
