"""The quantized all-gather's two copy ops: `torch.ops.simplefsdp.quant_copy_in` / `quant_copy_out`.

    slot = quant_copy_in(shards, chunks, code_dtype, block)                # uint8 [slot]: this rank's
    full = quant_copy_out(wait(all_gather(slot)), chunks, sizes, ndims, world,
                          code_dtype, block, dtype)                         # each in its shape, in dtype

The bytes are `quantize.py`'s (the specification, and the torch-ops implementation the CPU runs);
where the plain copy ops run Triton ([Note: kernel selection] in `copy_ops.py`) these run
`triton_quant.py`'s kernels, one launch per bucket each, bit for bit the same;
they are registered like the plain copy ops (`copy_ops.py`: one `CompositeExplicitAutograd` kernel,
a fake kernel, no derivative -- the quantized gather's backward is its own, see
`simplefsdp/quantized_gather.py`), checked up front, and a bucket of any size is one call each.
"""

from __future__ import annotations

import math

import torch

from simplefsdp._compat import OpOverload
from simplefsdp.kernels import quantize
from simplefsdp.kernels.copy_ops import (
    _check_chunks,
    _check_dtype,
    _check_slot,
    _check_tensors,
    _flat,
    _register,
    _use_triton,
    split_shapes,
)

__all__ = ["QUANT_COPY_IN", "QUANT_COPY_OUT", "QUANT_FAKE_IMPLS"]


def _check_code_dtype(code_dtype: torch.dtype, block: int) -> None:
    if code_dtype not in quantize.CODE_DTYPES:
        raise ValueError(f"code_dtype is {code_dtype}; supported: {', '.join(map(str, quantize.CODE_DTYPES))}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")


def _quant_copy_in(shards: list[torch.Tensor], chunks: list[int], code_dtype: torch.dtype, block: int) -> torch.Tensor:
    """This rank's `[slot]` bytes, a new tensor: `shards` quantized (`quantize.py`); the all-gather
    sends it ([Note: no rank in the graph] in `passes/bucket.py`)."""
    _check_tensors("shards", shards)
    _check_code_dtype(code_dtype, block)
    _check_slot(shards, chunks)
    if not shards or not _use_triton(shards[0]):
        return quantize.quantize_slot(shards, chunks, code_dtype, block)
    from simplefsdp.kernels import triton_quant

    layout = quantize.slot_layout(chunks, block)
    slot = torch.empty(layout.nbytes, dtype=torch.uint8, device=shards[0].device)
    triton_quant.quantize_into([_flat(s) for s in shards], layout, slot, code_dtype)
    return slot


def _quant_copy_in_fake(shards, chunks, code_dtype, block):
    device = shards[0].device if shards else torch.device("cpu")
    return torch.empty(quantize.slot_layout(chunks, block).nbytes, dtype=torch.uint8, device=device)


QUANT_COPY_IN: OpOverload = _register(
    "quant_copy_in(Tensor[] shards, SymInt[] chunks, ScalarType code_dtype, SymInt block) -> Tensor",
    _quant_copy_in,
    _quant_copy_in_fake,
)


def _quant_copy_out(
    gathered: torch.Tensor,
    chunks: list[int],
    sizes: list[int],
    ndims: list[int],
    world: int,
    code_dtype: torch.dtype,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each member's full value, dequantized into `dtype`, padding stripped, in its shape
    (`split_shapes(sizes, ndims)`), from the gathered `[world * slot]` bytes."""
    _check_code_dtype(code_dtype, block)
    _check_dtype("dtype", dtype)
    if gathered.dtype != torch.uint8:
        raise ValueError(f"gathered has dtype {gathered.dtype}; the quantized gather's buffer is uint8")
    shapes = split_shapes(sizes, ndims)
    _check_chunks(chunks, len(shapes))
    layout = quantize.slot_layout(chunks, block)
    if gathered.numel() != world * layout.nbytes:
        raise ValueError(f"gathered has {gathered.numel()} bytes; world {world} x slot {layout.nbytes} expected")
    for i, (c, shape) in enumerate(zip(chunks, shapes, strict=True)):
        if any(d < 0 for d in shape) or math.prod(shape) > world * c:
            raise ValueError(f"shape {shape} of output {i} does not fit {world} chunks of {c}")
    numels = [math.prod(shape) for shape in shapes]
    if not _use_triton(gathered):
        flat = quantize.dequantize_gathered(gathered.contiguous(), chunks, numels, world, code_dtype, block, dtype)
        return [value.view(shape) for value, shape in zip(flat, shapes, strict=True)]
    from simplefsdp.kernels import triton_quant

    outs = [torch.empty(shape, dtype=dtype, device=gathered.device) for shape in shapes]
    if outs:
        triton_quant.dequantize_into(_aligned(gathered), layout, [o.view(-1) for o in outs], world, code_dtype)
    return outs


def _aligned(gathered: torch.Tensor) -> torch.Tensor:
    """`gathered` contiguous and 16-byte aligned (the kernel reads each slot's fp32 scales where the
    layout puts them): a view when it already is (the all-gather's own buffer), else a copy."""
    flat = gathered.contiguous()
    return flat if flat.data_ptr() % quantize.ALIGN == 0 else flat.clone()


def _quant_copy_out_fake(gathered, chunks, sizes, ndims, world, code_dtype, block, dtype):
    return [gathered.new_empty(shape, dtype=dtype) for shape in split_shapes(sizes, ndims)]


QUANT_COPY_OUT: OpOverload = _register(
    "quant_copy_out(Tensor gathered, SymInt[] chunks, SymInt[] sizes, SymInt[] ndims, SymInt world, "
    "ScalarType code_dtype, SymInt block, ScalarType dtype) -> Tensor[]",
    _quant_copy_out,
    _quant_copy_out_fake,
)

# the fake functions the graph pass calls directly ([Note: the copy ops' output metadata, directly])
QUANT_FAKE_IMPLS = {QUANT_COPY_IN: _quant_copy_in_fake, QUANT_COPY_OUT: _quant_copy_out_fake}
