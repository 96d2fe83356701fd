"""The copy kernel compiles for a GPU, on a machine without one.

The interpreter (`test_copy_ops.py`) runs the kernel's Python, not its compilation: type errors of
loop-carried values, pointer casts Triton cannot lower or accesses it will not vectorize only show
when the kernel is compiled for a GPU target. Triton's NVIDIA backend compiles to PTX and a cubin
without a driver, so this test does that for sm_90 (H100 / H200), for every compile-time variant the
host wrapper launches, and checks that a table with aligned segments gives 16-byte accesses (the
`ALIGN` hint of `triton_copy._alignment`). Compiling is not running: the `gpu`-marked tests do that.
"""

from __future__ import annotations

import importlib
import itertools
import re

import pytest
import torch

from simplefsdp.kernels import copy_ops

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend is not installed")


@pytest.fixture(scope="module")
def compiled_mode():
    """`triton_copy` decorated for compilation (not the interpreter), restored to the env's mode after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        from simplefsdp.kernels import triton_copy

        importlib.reload(triton_copy)
        yield triton_copy
    importlib.reload(triton_copy)
    copy_ops._kernel_choice.cache_clear()


def _compile_sm90(triton_copy, **constants):
    from triton.backends.compiler import GPUTarget

    fn = triton_copy._bucket_copy_kernel
    signature = {"table": "*i64", "scale": "fp32", **dict.fromkeys(constants, "constexpr")}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("align", [1, 8])
def test_kernel_compiles_for_sm90_and_vectorizes_aligned_tables(compiled_mode, align):
    triton_copy = compiled_mode
    for dtype, has_scale in itertools.product(triton_copy.DTYPE_CODES, [False, True]):
        kernel = _compile_sm90(
            triton_copy,
            HAS_SCALE=has_scale,
            DST=triton_copy._TL_DTYPES[dtype],
            DST_CODE=triton_copy.DTYPE_CODES[dtype],
            HEADER=triton_copy._HEADER,
            FIELDS=triton_copy._FIELDS,
            BLOCK=1024,
            ALIGN=align,
        )
        assert kernel.asm["cubin"], f"{dtype}, scale {has_scale}: no cubin"
        stores = set(re.findall(r"st\.global[.\w]*", kernel.asm["ptx"]))
        if align == 8:
            assert stores == {"st.global.v4.b32"}, f"{dtype}: {stores}"
        else:
            assert "st.global.v4.b32" not in stores, f"{dtype}: vectorized without the alignment hint: {stores}"


def test_alignment_claims_only_what_holds(compiled_mode):
    triton_copy = compiled_mode
    from simplefsdp.kernels import launch

    def align(chunks, numels, address=0):
        plan = launch.plan_launch(kind="pack", chunks=chunks, numels=numels, rows=2)
        srcs = [torch.empty(n, dtype=torch.bfloat16) for n in numels]
        values = triton_copy._table(plan, srcs, [torch.empty(2 * sum(chunks), dtype=torch.bfloat16)] * len(srcs))
        return triton_copy._alignment(values)

    assert align([4096, 64], [4096, 64]) == 8
    assert align([4096, 63], [4096, 63]) == 1  # an offset (and a length) off the 8-element grid
    assert align([4096, 64], [4096, 60]) == 1  # a short shard: its limit is off the grid
    plan = launch.plan_launch(kind="pack", chunks=[8], numels=[8], rows=1)
    base = torch.empty(9, dtype=torch.bfloat16)
    values = triton_copy._table(plan, [base[1:]], [torch.empty(8, dtype=torch.bfloat16)])
    assert triton_copy._alignment(values) == 1  # a source 2 bytes past an aligned address
