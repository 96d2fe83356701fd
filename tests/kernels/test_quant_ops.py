"""The quantized gather's copy ops and byte format: `quantize.py` (the specification), the ops
(`quant_ops.py`) and their Triton kernels (`triton_quant.py`).

- the encode / decode steps against torch's own casts;
- the ops against the specification (any bucket, world, dtype, layout) and the dequantized values
  against the original ones within the format's error bound ([Note: quantized gathers]);
- the Triton kernels (the CPU interpreter here: `TRITON_INTERPRET=1`, or a GPU when there is one)
  bit for bit against the torch path: the whole copy-in slot, padding included, and every output
  value. fp16 outputs included: the interpreter's fp32 -> fp16 cast (NumPy's, in Triton 3.9) gives
  torch's bits, so they are compared exactly too.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from simplefsdp.kernels import quant_ops, quantize  # noqa: F401  (quant_ops registers the quant_copy_* ops)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = list(quantize.CODE_DTYPES)
CUDA = torch.cuda.is_available()
E4M3 = torch.float8_e4m3fn


# --- encode / decode against torch ---------------------------------------------------------------


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending (codes 0 .. 0x7E)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(E4M3).float()


def test_e4m3_encode_is_torchs_cast():
    """Round to nearest-even at every tie between neighbours and one fp32 ulp either side of it, at
    the values themselves, and at random values, both signs: torch's `.to(float8_e4m3fn)`."""
    values = _e4m3_values()
    ties = (values[:-1] + values[1:]) / 2  # exact in fp32
    near = torch.cat([ties, torch.nextafter(ties, values[1:]), torch.nextafter(ties, values[:-1]), values])
    y = torch.cat([near, torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 448])
    y = torch.cat([y, -y, torch.tensor([0.0, -0.0, 2.0**-10, 2.0**-149])])
    assert torch.equal(quantize.encode(y, E4M3), y.to(E4M3).view(torch.uint8))


def test_e4m3_decode_is_torchs_view():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: nan
    assert torch.equal(quantize.decode(codes, E4M3), codes.view(E4M3).float())


def test_int8_encode_is_round_half_even():
    random = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 254 - 127
    y = torch.cat([torch.arange(-127.0, 127.5, 0.5), random])  # every tie k + 1/2, and between
    codes = quantize.encode(y, torch.int8)
    assert torch.equal(codes.view(torch.int8), torch.round(y).to(torch.int8))
    assert torch.equal(quantize.decode(codes, torch.int8), torch.round(y))


# --- the ops against the specification ------------------------------------------------------------


@st.composite
def buckets(draw, *, max_world: int = 3):
    world = draw(st.integers(1, max_world))
    shapes = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=4))
    return {
        "world": world,
        "shapes": [(rows, cols) if cols > 1 else (rows,) for rows, cols in shapes],
        "src": draw(st.sampled_from(DTYPES)),
        "dst": draw(st.sampled_from(DTYPES)),
        "code": draw(st.sampled_from(CODES)),
        "block": draw(st.sampled_from([8, 16, 128, 1024])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _fulls(b) -> list[torch.Tensor]:
    """Random parameters for bucket `b`: each at its own magnitude (any binade its dtype holds: tiny
    and huge ones for fp32 and bf16), some zeros, every other one strided (a transpose's layout),
    every third in fp32 whatever the bucket's source dtype."""
    gen = torch.Generator().manual_seed(b["seed"])
    out = []
    for i, shape in enumerate(b["shapes"]):
        dtype = b["src"] if i % 3 else torch.float32
        low, high = (-12, 12) if dtype == torch.float16 else (-140, 120)
        x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(low, high, (), generator=gen).float())
        x = x * (torch.rand(shape, generator=gen) > 0.2)
        x = x.to(dtype)
        out.append(x.t().contiguous().t() if i % 2 and x.dim() == 2 else x)
    return out


def _chunk(shape, world: int) -> int:
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    rows = math.ceil(full.shape[0] / world)
    return full[rank * rows : (rank + 1) * rows]


def _sizes(shapes) -> tuple[list[int], list[int]]:
    return [d for shape in shapes for d in shape], [len(shape) for shape in shapes]


def _gather(b, fulls, chunks, device="cpu") -> torch.Tensor:
    """What the all-gather leaves: every rank's slot from that rank's copy-in, in rank order."""
    world = b["world"]
    slots = []
    for r in range(world):
        shards = [_shard(f, world, r).to(device) for f in fulls]
        slots.append(torch.ops.simplefsdp.quant_copy_in(shards, chunks, b["code"], b["block"]).cpu())
    return torch.cat(slots)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, nans where nans (torch.equal counts nan as unequal)."""
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]  # -0.0 and 0.0 differ too
    assert torch.equal(got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))


@settings(max_examples=60, deadline=None)
@given(b=buckets())
def test_ops_are_the_specification(b):
    """The ops (torch path) give `quantize_slot`'s slot and `dequantize_gathered`'s values, each
    output in its parameter's shape, on every rank, for any input layout."""
    fulls, world = _fulls(b), b["world"]
    chunks = [_chunk(f.shape, world) for f in fulls]
    gathered = _gather(b, fulls, chunks)
    layout = quantize.slot_layout(chunks, b["block"])
    for r, slot in enumerate(gathered.view(world, layout.nbytes)):
        shards = [_shard(f, world, r).contiguous() for f in fulls]
        assert torch.equal(slot, quantize.quantize_slot(shards, chunks, b["code"], b["block"]))
    outs = torch.ops.simplefsdp.quant_copy_out(gathered, chunks, *_sizes([f.shape for f in fulls]), world,
                                               b["code"], b["block"], b["dst"])  # fmt: skip
    numels = [f.numel() for f in fulls]
    want = quantize.dequantize_gathered(gathered, chunks, numels, world, b["code"], b["block"], b["dst"])
    for out, w, full in zip(outs, want, fulls, strict=True):
        assert out.shape == full.shape
        assert out.is_contiguous(), "fresh tensors, as the fake kernel says"
        _same(out.reshape(-1), w)


# --- error bounds ----------------------------------------------------------------------------------


def _bound(x: torch.Tensor, code: torch.dtype, block: int) -> torch.Tensor:
    """Per element of fp32 `x` (a multiple of `block` long), how far its dequantized fp32 value may be:
    int8, half a code step: absmax / 254; e4m3fn, half an ulp of the code: |x| * 2**-4 for normal
    codes, scale * 2**-10 for subnormal ones (scale = absmax / 448); plus absmax * 2**-20 for the fp32
    roundings of the inverse, the product and the scale (16 ulps of absmax; they are a few), plus
    2**-140 for the scale's own underflow in tiny blocks (448 times its absolute error 2**-150)."""
    absmax = x.view(-1, block).abs().amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)
    step = absmax / 254 if code == torch.int8 else torch.maximum(x.abs() * 2.0**-4, absmax / 448 * 2.0**-10)
    return step + absmax * 2.0**-20 + 2.0**-140


@st.composite
def blocks_of_values(draw):
    """fp32 values in whole blocks, each block at its own magnitude: normal, huge (to 2**127), tiny,
    subnormal (to 2**-149), with zeros mixed in and whole-zero blocks."""
    block = draw(st.sampled_from([8, 32, 128, 512]))
    n_blocks = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    exponents = torch.tensor(draw(st.lists(st.integers(-149, 126), min_size=n_blocks, max_size=n_blocks)))
    x = (torch.rand(n_blocks, block, generator=gen) * 2 - 1) * torch.exp2(exponents.double())[:, None]
    x = x.float() * (torch.rand(n_blocks, block, generator=gen) > draw(st.sampled_from([0.0, 0.3, 1.0])))
    return x.reshape(-1), block


@settings(max_examples=30, deadline=None)
@given(values=blocks_of_values(), code=st.sampled_from(CODES))
def test_scales_are_ieee_quotients(values, code):
    """Each block's scale is absmax / QMAX correctly rounded (computed here in float64, then rounded
    once to fp32: exact for a quotient of fp32 values), not a reciprocal times QMAX."""
    x, block = values
    layout = quantize.slot_layout([x.numel()], block)
    slot = quantize.quantize_slot([x], [x.numel()], code, block)
    scales = slot[layout.scales_start : layout.scales_start + 4 * layout.n_scales].view(torch.float32)
    absmax = x.view(-1, block).abs().amax(dim=1)
    assert torch.equal(scales, (absmax.double() / quantize.QMAX[code]).float())


def _dequantize(x: torch.Tensor, code: torch.dtype, block: int, dtype: torch.dtype) -> torch.Tensor:
    buf = torch.ops.simplefsdp.quant_copy_in([x], [x.numel()], code, block)
    (out,) = torch.ops.simplefsdp.quant_copy_out(buf, [x.numel()], [x.numel()], [1], 1, code, block, dtype)
    return out


@settings(max_examples=100, deadline=None)
@given(values=blocks_of_values(), code=st.sampled_from(CODES))
@example(values=(torch.tensor([1e-37, 0.5e-37, 0.0, -0.25e-37] * 2), 8), code=torch.int8)  # inverse past fp32
@example(values=(torch.tensor([1e-37, 0.5e-37, 0.0, -0.25e-37] * 2), 8), code=E4M3)
@example(values=(torch.tensor([3e38, -1e38, 1.0, 0.0] * 2), 8), code=E4M3)
def test_dequantized_values_are_within_the_bound(values, code):
    """fp32 outputs within `_bound`; bf16 outputs are those rounded once more (relative 2**-8, and half
    bf16's smallest step, 2**-134, among subnormals); fp16, where in its range, relative 2**-11 and
    2**-25 among its subnormals."""
    x, block = values
    out = _dequantize(x, code, block, torch.float32)
    err = (out - x).abs()
    bound = _bound(x, code, block)
    assert bool((err <= bound).all()), f"{(err - bound).max().item()} over at {(err - bound).argmax().item()}"
    bf16 = _dequantize(x, code, block, torch.bfloat16).float()
    assert bool(((bf16 - out).abs() <= out.abs() * 2.0**-8 + 2.0**-134).all())
    fp16 = _dequantize(x, code, block, torch.float16).float()
    fits = out.abs() <= 65504
    assert bool(((fp16 - out).abs()[fits] <= out.abs()[fits] * 2.0**-11 + 2.0**-25).all())


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_block_is_nan_others_within_bound(code, bad):
    block = 16
    x = torch.randn(4 * block, generator=torch.Generator().manual_seed(2))
    x[block + 5] = bad
    out = _dequantize(x, code, block, torch.float32)
    assert bool(out[block : 2 * block].isnan().all()), "the whole block decodes to nan"
    keep = torch.cat([torch.arange(block), torch.arange(2 * block, 4 * block)])
    assert bool(((out[keep] - x[keep]).abs() <= _bound(x.nan_to_num(0.0, 0.0, 0.0), code, block)[keep]).all())
    assert bool(_dequantize(x, code, block, torch.bfloat16)[block : 2 * block].isnan().all())


# --- bad inputs ------------------------------------------------------------------------------------


def test_bad_inputs_are_named():
    x = torch.randn(16)
    copy_in, copy_out = torch.ops.simplefsdp.quant_copy_in, torch.ops.simplefsdp.quant_copy_out
    with pytest.raises(ValueError, match=r"code_dtype is torch.float16; supported: torch.int8, torch.float8_e4m3fn"):
        copy_in([x], [16], torch.float16, 8)
    with pytest.raises(ValueError, match="block must be a power of two, got 96"):
        copy_in([x], [16], torch.int8, 96)
    with pytest.raises(ValueError, match=r"shards\[0\] has 16 elements, more than its chunk of 8"):
        copy_in([x], [8], torch.int8, 8)
    buf = copy_in([x], [16], torch.int8, 8)  # 16 codes + 2 scales: 32 bytes
    with pytest.raises(ValueError, match="gathered has 32 bytes; world 2 x slot 32 expected"):
        copy_out(buf, [16], [32], [1], 2, torch.int8, 8, torch.float32)
    with pytest.raises(ValueError, match="block must be a power of two, got 0"):
        copy_out(buf, [16], [16], [1], 1, torch.int8, 0, torch.float32)
    with pytest.raises(ValueError, match=r"shape \[17\] of output 0 does not fit 1 chunks of 16"):
        copy_out(buf, [16], [17], [1], 1, torch.int8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"gathered has dtype torch.float32; the quantized gather's buffer is uint8"):
        copy_out(buf.view(torch.float32), [16], [16], [1], 1, torch.int8, 8, torch.float32)


# --- the Triton kernels ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_device():
    """The device the Triton kernels run on (the GPU, or the CPU through the interpreter) and the
    calls of their wrappers (one launch each at most), so a test can tell the kernels ran."""
    with pytest.MonkeyPatch.context() as patch:
        if not CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
            patch.setenv("SIMPLEFSDP_TRITON_ON_CPU", "1")
        from simplefsdp.kernels import copy_ops, triton_copy, triton_quant

        importlib.reload(triton_copy)  # decorate the kernels in interpreter mode
        importlib.reload(triton_quant)  # ... and these, which call triton_copy's helpers
        if not CUDA and (problem := triton_copy.interpreter_problem()):
            pytest.skip(problem)  # a third-party incompatibility, refused with this reason by `supports`
        copy_ops._kernel_choice.cache_clear()
        launches: list[str] = []
        for name in ("quantize_into", "dequantize_into"):
            patch.setattr(triton_quant, name, _counted(getattr(triton_quant, name), name, launches))
        yield ("cuda" if CUDA else "cpu"), launches
    copy_ops._kernel_choice.cache_clear()


def _counted(fn, name, launches):
    def counted(*args, **kwargs):
        launches.append(name)
        return fn(*args, **kwargs)

    return counted


def _with_non_finite(fulls, seed: int) -> list[torch.Tensor]:
    """`fulls` with an inf or a nan planted in the first non-empty one (every other seed), in its layout."""
    if seed % 2 or not any(f.numel() for f in fulls):
        return fulls
    i = next(i for i, f in enumerate(fulls) if f.numel())
    flat = fulls[i].reshape(-1).clone()
    flat[seed % flat.numel()] = float("nan") if seed % 4 else float("-inf")
    planted = torch.empty_like(fulls[i]).copy_(flat.view(fulls[i].shape))  # empty_like keeps the strides
    return [planted if j == i else f for j, f in enumerate(fulls)]


@settings(max_examples=15, deadline=None)
@given(b=buckets(), block=st.sampled_from([8, 32, 128, 2048]))
def test_triton_is_the_torch_path_bit_for_bit(triton_device, b, block):
    """Copy-in: every rank's whole slot (codes, scales, padding) as the torch path writes it;
    copy-out: every value (fp16 too, see the module docstring); one kernel call per op call."""
    device, launches = triton_device
    del launches[:]
    b = {**b, "block": block}
    fulls, world = _with_non_finite(_fulls(b), b["seed"]), b["world"]
    chunks = [_chunk(f.shape, world) for f in fulls]
    gathered = _gather(b, fulls, chunks, device)  # the Triton kernel's slots
    layout = quantize.slot_layout(chunks, block)
    for r, slot in enumerate(gathered.view(world, layout.nbytes)):
        shards = [_shard(f, world, r) for f in fulls]
        assert torch.equal(slot, quantize.quantize_slot(shards, chunks, b["code"], block)), f"rank {r}'s slot"
    sizes = _sizes([f.shape for f in fulls])
    outs = torch.ops.simplefsdp.quant_copy_out(gathered.to(device), chunks, *sizes, world, b["code"], block, b["dst"])
    numels = [f.numel() for f in fulls]
    want = quantize.dequantize_gathered(gathered, chunks, numels, world, b["code"], block, b["dst"])
    for out, w, full in zip(outs, want, fulls, strict=True):
        assert out.shape == full.shape
        _same(out.cpu().reshape(-1), w)
    assert launches == ["quantize_into"] * world * bool(fulls) + ["dequantize_into"] * bool(fulls)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(b=buckets(), block=st.sampled_from([8, 32, 128, 2048]))
def test_triton_is_the_torch_path_on_many_buckets(triton_device, b, block):
    test_triton_is_the_torch_path_bit_for_bit.hypothesis.inner_test(triton_device, b, block)


def test_triton_large_and_small_blocks(triton_device):
    """Blocks larger than a tile (8192: one block a program, a partial last one) and small ones (8:
    128 a program, the second member starting mid-tile in the code bytes), int8 and e4m3fn."""
    device, _ = triton_device
    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(18000, generator=gen), torch.randn(154, generator=gen).bfloat16()]
    chunks = [9000, 77]
    for code in CODES:
        for block in (8, 8192):
            b = {"world": 2, "code": code, "block": block}
            gathered = _gather(b, fulls, chunks, device)
            for r, slot in enumerate(gathered.view(2, -1)):
                want = quantize.quantize_slot([_shard(f, 2, r) for f in fulls], chunks, code, block)
                assert torch.equal(slot, want), (code, block, r)
            outs = torch.ops.simplefsdp.quant_copy_out(gathered.to(device), chunks, [18000, 154], [1, 1], 2, code,
                                                       block, torch.bfloat16)  # fmt: skip
            want = quantize.dequantize_gathered(gathered, chunks, [18000, 154], 2, code, block, torch.bfloat16)
            for o, w in zip(outs, want, strict=True):
                assert torch.equal(o.cpu(), w), (code, block)


@pytest.mark.parametrize("code", CODES)
def test_triton_writes_every_byte_it_owns(triton_device, code):
    """Into buffers full of junk (0xA5 bytes, nan outputs): the whole slot, padding gaps included, is
    the specification's, and every output element is written."""
    from simplefsdp.kernels import triton_quant

    device, _ = triton_device
    gen = torch.Generator().manual_seed(4)
    shards, chunks, block = [torch.randn(13, generator=gen), torch.randn(3, generator=gen).half()], [13, 5], 8
    layout = quantize.slot_layout(chunks, block)
    assert layout.scales_start > sum(chunks)
    assert layout.nbytes > layout.scales_start + 4 * layout.n_scales
    slot = torch.full((layout.nbytes,), 0xA5, dtype=torch.uint8, device=device)
    triton_quant.quantize_into([s.to(device) for s in shards], layout, slot, code)
    assert torch.equal(slot.cpu(), quantize.quantize_slot(shards, chunks, code, block))
    gathered = slot.repeat(2)
    outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device) for n in (26, 9)]
    triton_quant.dequantize_into(gathered, layout, outs, 2, code)
    want = quantize.dequantize_gathered(gathered.cpu(), chunks, [26, 9], 2, code, block, torch.bfloat16)
    for o, w in zip(outs, want, strict=True):
        assert torch.equal(o.cpu(), w)
