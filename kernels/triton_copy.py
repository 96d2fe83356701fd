"""One Triton kernel behind the three bucket copy ops: a whole bucket's strided, masked, casting copy in one launch.

Every op moves, for each parameter `i` of a bucket, `rows` rows of `chunk_i` elements between a
per-parameter flat tensor and a flat bucket buffer whose rows are `bucket` elements long:

    pack   (copy-in):  dst[r * bucket + offset_i + j] = cast(src_i[r * chunk_i + j])   (0 past src_i's end)
    unpack (copy-out): dst_i[r * chunk_i + j]        = src[r * bucket + offset_i + j]  (dropped past dst_i's end)

with `rows = world` for the reduce-scatter copy-in and the all-gather copy-out and `rows = 1` for
the all-gather copy-in. Each element is read once and written once; casts happen in registers. The
grid and the tile numbering come from `launch.py` (a pure function; see [Note: grid limits] there).

[Note: one launch per bucket: a table of segments]
A Triton kernel takes a fixed list of arguments, not a Python list of tensors, so the per-parameter
tensors reach it through a table: one int64 device tensor, a header `[segments, total tiles]` and
then one row per segment holding the source's and destination's data pointers (`data_ptr()` as an
integer), the source's dtype code and the segment's strides, offsets, limits and tile numbering. The
kernel loads a segment's pointers from the table and casts them with `tl.pointer_type(...)` to the
element type: a runtime branch on the dtype code picks fp32, bf16 or fp16 for the source (a bucket
mixes dtypes), the destination's type is a compile-time constant (one per op call). The same code
runs in the CPU interpreter (`TRITON_INTERPRET=1`), where a pointer is a host address: checked by
the kernel tests, which run it there bit for bit against `reference.py`.
What this costs and assumes: the table is built on the host and copied to the device (pinned,
non-blocking: about 100 bytes a parameter) unless an identical one was sent before (below), so a
launch is not CUDA-graph capturable; every tensor must be on the launch's device and stay alive
until the kernel ran, which holds because the op's caller holds them and kernels on one stream run
in order; the kernel cannot check the pointers, so the host wrapper checks devices and sizes first.

[Note: the table is cached on the device]
Sending the table (a host tensor, a pinned staging buffer, a copy) is host time the GPU waits for
when the copy itself is short. Measured on an H200 (torch 2.11, Triton 3.6) for the all-gather
copy-in of one Llama-3-8B block's shards at world 8 (27 M elements): the kernel alone 45 us a call
back to back (3.6 TB/s; a plain copy of as many bytes: 4.0 TB/s); the whole op 231 us with a table
sent per call and 172 us with this cache (timed with a sync around one call; host time per call
220 -> 141 us). The
table's contents are the key: a call whose table equals one sent before (same plan, same data
pointers -- the steady state of a training loop, where parameters stay put and the caching allocator
hands the same buffers back) reuses that device tensor; a hit is exact by construction. The cache is
bounded (`_TABLE_CACHE`, least recently used out) and per device and stream.

[Note: exact bf16 rounding] Every value written as bf16 from another dtype is rounded to
nearest-even with integer bit arithmetic (add 0x7FFF plus the kept lowest bit, drop 16 bits; NaNs
stay NaN), so the result equals torch's `.to(torch.bfloat16)` both on a GPU and in the CPU
interpreter. The interpreter's own fp32 -> bf16 cast does not round like torch (on torch 2.13 with
Triton 3.x, about half of random values came out 1 ulp off, also with `fp_downcast_rounding="rtne"`);
a GPU's cast does. Reading bf16, the kernel widens by shifting the bits into fp32's top half (what
a GPU's cast does): the interpreter's own bf16 -> fp32 cast flushes subnormal bf16 values (below
2**-126) to wrong values. Other down-casts (to fp16) use Triton's cast: exact on a GPU, within 1 ulp in the
interpreter -- the tests say so. A segment whose source already has the destination's dtype (and no
scale) is copied bit for bit, without going through fp32.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from simplefsdp._compat import major_minor
from simplefsdp.kernels import launch

__all__ = ["DTYPE_CODES", "interpreter_problem", "launch_bucket", "pack", "supports", "unpack"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# the table: a header, then one row of `_FIELDS` int64 per segment, in this column order
_HEADER = 2  # [number of segments, total tiles]
_COLUMNS = (
    "tile_start",
    "tiles_per_row",
    "row_len",
    "src_ptr",
    "src_code",
    "src_stride",
    "src_offset",
    "src_limit",
    "dst_ptr",
    "dst_stride",
    "dst_offset",
    "dst_limit",
)
_FIELDS = len(_COLUMNS)
_TABLE_CACHE = 512  # device tables kept (a few per bucket and op: ~100 bytes a parameter each)
_tables: collections.OrderedDict[tuple, tuple[torch.Tensor, int]] = collections.OrderedDict()


def interpreter_problem(*, triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """[Note: Triton 3.6's interpreter and NumPy 2.4]
    Triton's interpreter turns a one-element program-id array into a loop bound with `int(array)`,
    which NumPy 2.4 refuses for arrays that are not 0-d: every launch of this kernel then fails
    inside the interpreter with "only 0-dimensional arrays can be converted to Python scalars"
    (triton-lang/triton#9171). Seen with Triton 3.6.0 (torch 2.11's) and NumPy 2.4.6; the same
    kernels run with NumPy 2.3.5, and Triton 3.9.0 squeezes the array first. Triton before 3.7 under
    NumPy 2.4 or later is therefore refused with that reason (the copy ops then run their torch-ops
    implementations). None where the interpreter can run the kernel (without NumPy it cannot run
    at all, and says so itself)."""
    try:
        import numpy
    except ImportError:
        return None
    triton_version = triton_version or triton.__version__
    numpy_version = numpy_version or numpy.__version__
    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run under NumPy {numpy_version} "
            "(triton-lang/triton#9171): install numpy<2.4, or a newer Triton"
        )
    return None


def supports(device: torch.device) -> str | None:
    """None when this kernel can run on `device`, else why not: a GPU Triton has a driver for, or
    the CPU when the kernels were defined in interpreter mode (`TRITON_INTERPRET=1` at import) and
    the interpreter can run them ([Note: Triton 3.6's interpreter and NumPy 2.4])."""
    interpreted = not isinstance(_bucket_copy_kernel, triton.runtime.JITFunction)
    if device.type == "cpu":
        if not interpreted:
            return "the CPU runs Triton only in the interpreter (TRITON_INTERPRET=1 before import)"
        return interpreter_problem()
    if interpreted:
        return f"Triton is in interpreter mode, which runs on the CPU, not on {device.type}"
    if device.type != "cuda":
        return f"no Triton backend for device type {device.type}"
    try:
        backend = triton.runtime.driver.active.get_current_target().backend
    except RuntimeError as e:  # no usable driver
        return f"Triton has no active GPU driver ({e})"
    return None if backend in ("cuda", "hip") else f"Triton's active backend is {backend!r}"


@triton.jit
def _to_bf16_rtne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = x != x
    rounded = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _pointer(address, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """The int64 `address` as a pointer to DTYPE, aligned to `2 * ALIGN` bytes (see `_alignment`)."""
    return tl.multiple_of(address.to(tl.pointer_type(DTYPE)), 2 * ALIGN)


@triton.jit
def _load_fp32(address, code, index, mask, ALIGN: tl.constexpr):
    """`address` read as fp32 (code 0), bf16 (1) or fp16 (2), widened to fp32 (exact)."""
    if code == 0:
        x = tl.load(_pointer(address, tl.float32, ALIGN) + index, mask=mask, other=0.0)
    elif code == 1:  # bf16 is fp32's top half: widened by a shift ([Note: exact bf16 rounding])
        bits = tl.load(_pointer(address, tl.uint16, ALIGN) + index, mask=mask, other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(_pointer(address, tl.float16, ALIGN) + index, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _narrow(x, DST: tl.constexpr, DST_CODE: tl.constexpr):
    if DST_CODE == 1:
        y = _to_bf16_rtne(x)
    else:
        y = x.to(DST)
    return y


@triton.jit
def _find_segment(table, n_segments, tile, HEADER: tl.constexpr, FIELDS: tl.constexpr):
    """The largest segment whose first tile is <= `tile` (tile starts are non-decreasing; an empty
    segment shares its start with the next, which wins)."""
    lo = n_segments * 0  # an int64 scalar, like hi
    hi = n_segments
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(table + HEADER + mid * FIELDS) <= tile
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _bucket_copy_kernel(
    table,
    scale,
    HAS_SCALE: tl.constexpr,
    DST: tl.constexpr,
    DST_CODE: tl.constexpr,
    HEADER: tl.constexpr,
    FIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    n_segments = tl.load(table)
    total_tiles = tl.load(table + 1)
    for tile in range(tl.program_id(0).to(tl.int64), total_tiles, tl.num_programs(0).to(tl.int64)):
        row = table + HEADER + _find_segment(table, n_segments, tile, HEADER, FIELDS) * FIELDS
        local = tile - tl.load(row)
        tiles_per_row = tl.load(row + 1)
        r = local // tiles_per_row
        src_ptr, src_code = tl.load(row + 3), tl.load(row + 4)
        dst_ptr = tl.load(row + 8)
        row_len = tl.multiple_of(tl.load(row + 2), ALIGN)
        src_start = tl.multiple_of(r * tl.load(row + 5) + tl.load(row + 6), ALIGN)
        src_limit = tl.multiple_of(tl.load(row + 7), ALIGN)
        dst_start = tl.multiple_of(r * tl.load(row + 9) + tl.load(row + 10), ALIGN)
        dst_limit = tl.multiple_of(tl.load(row + 11), ALIGN)
        cols = (local - r * tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < row_len
        src_index = src_start + cols
        load = in_row & (src_index < src_limit)
        dst_index = dst_start + cols
        store = in_row & (dst_index < dst_limit)
        if HAS_SCALE:
            y = _narrow(_load_fp32(src_ptr, src_code, src_index, load, ALIGN) * scale, DST, DST_CODE)
        elif src_code == DST_CODE:
            y = tl.load(_pointer(src_ptr, DST, ALIGN) + src_index, mask=load, other=0.0)
        else:
            y = _narrow(_load_fp32(src_ptr, src_code, src_index, load, ALIGN), DST, DST_CODE)
        tl.store(_pointer(dst_ptr, DST, ALIGN) + dst_index, y, mask=store)


def _table(plan: launch.LaunchPlan, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[int]:
    """The kernel's table (see [Note: one launch per bucket: a table of segments]) as ints."""
    values = [len(plan.segments), plan.total_tiles]
    for start, seg, src, dst in zip(plan.tile_starts[:-1], plan.segments, srcs, dsts, strict=True):
        values += [start, seg.tiles_per_row, seg.row_len, src.data_ptr(), DTYPE_CODES[src.dtype]]
        values += [seg.src_stride, seg.src_offset, seg.src_limit, dst.data_ptr()]
        values += [seg.dst_stride, seg.dst_offset, seg.dst_limit]
    return values


def _alignment(values: list[int]) -> int:
    """`ALIGN`: 8 when every pointer of the table is 16-byte aligned and every size, stride and
    offset a multiple of 8 elements (then groups of 8 elements share their masks and a 16-byte
    access: the compiler vectorizes), else 1 (no claim). Pointers are the table's `*_ptr` columns."""
    pointers = {_COLUMNS.index("src_ptr"), _COLUMNS.index("dst_ptr")}
    sizes = {_COLUMNS.index(c) for c in ("row_len", "src_stride", "src_offset", "src_limit")}
    sizes |= {_COLUMNS.index(c) for c in ("dst_stride", "dst_offset", "dst_limit")}
    rows = [values[i : i + _FIELDS] for i in range(_HEADER, len(values), _FIELDS)]
    aligned = all(row[c] % 16 == 0 for row in rows for c in pointers)
    return 8 if aligned and all(row[c] % 8 == 0 for row in rows for c in sizes) else 1


def _device_table(
    values: list[int], device: torch.device, summarize: Callable[[list[int]], int] = _alignment
) -> tuple[torch.Tensor, int]:
    """The table `values` as an int64 tensor on `device` and `summarize(values)` (the copy kernel's
    `_alignment`; the quantized copies' tables pass their own): from the cache when this exact table
    was sent before (see [Note: the table is cached on the device])."""
    # the stream too: a table is copied and first read on one stream, so another stream never reads
    # it before its copy lands, nor does the allocator hand its memory out while that stream uses it
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, summarize, tuple(values))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    table = torch.tensor(values, dtype=torch.int64)
    if device.type != "cpu":
        table = table.pin_memory().to(device, non_blocking=True)
    _tables[key] = entry = (table, summarize(values))
    if len(_tables) > _TABLE_CACHE:
        _tables.popitem(last=False)
    return entry


def launch_bucket(
    plan: launch.LaunchPlan, srcs: list[torch.Tensor], dsts: list[torch.Tensor], *, scale: float = 1.0
) -> None:
    """Run `plan` with segment i reading `srcs[i]` and writing `dsts[i]` (flat, contiguous, on one
    device, every `dsts[i]` of one dtype): one kernel launch, none for an empty plan."""
    if plan.grid[0] == 0:
        return
    device, dtype = dsts[0].device, dsts[0].dtype
    for what, tensors in (("source", srcs), ("destination", dsts)):
        for i, t in enumerate(tensors):
            if t.device != device or not t.is_contiguous() or t.dtype not in DTYPE_CODES:
                raise ValueError(f"{what} {i}: {t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    if any(t.dtype != dtype for t in dsts):
        raise ValueError(f"destinations of one launch share a dtype; got {sorted({str(t.dtype) for t in dsts})}")
    for seg, src, dst in zip(plan.segments, srcs, dsts, strict=True):
        if seg.src_limit > src.numel() or seg.dst_limit > dst.numel():
            raise ValueError(f"a segment reads {seg.src_limit} / writes {seg.dst_limit} elements of tensors of "
                             f"{src.numel()} / {dst.numel()}")  # fmt: skip
    table, align = _device_table(_table(plan, srcs, dsts), device)
    _bucket_copy_kernel[plan.grid](
        table,
        float(scale),
        HAS_SCALE=scale != 1.0,
        DST=_TL_DTYPES[dtype],
        DST_CODE=DTYPE_CODES[dtype],
        HEADER=_HEADER,
        FIELDS=_FIELDS,
        BLOCK=plan.block,
        ALIGN=align,
    )


def pack(srcs: list[torch.Tensor], chunks: list[int], out: torch.Tensor, *, rows: int, scale: float = 1.0) -> None:
    """`out` (flat, `rows * sum(chunks)`) <- each flat contiguous `srcs[i]` split into `rows` chunks: one launch."""
    plan = launch.plan_launch(kind="pack", chunks=chunks, numels=[s.numel() for s in srcs], rows=rows)
    launch_bucket(plan, srcs, [out] * len(srcs), scale=scale)


def unpack(src: torch.Tensor, chunks: list[int], outs: list[torch.Tensor], *, rows: int) -> None:
    """Each flat contiguous `outs[i]` <- its `rows` chunks of the flat bucket buffer `src` (the
    inverse of `pack`): one launch."""
    plan = launch.plan_launch(kind="unpack", chunks=chunks, numels=[o.numel() for o in outs], rows=rows)
    launch_bucket(plan, [src] * len(outs), outs)
