"""The quantized all-gather of one sharded parameter, with a straight-through gradient.

`MixedPrecisionPolicy(gather_dtype="int8" | "float8_e4m3fn")` makes every gather of a sharded parameter

    forward:  slot = quant_copy_in([shard], ...)            # codes + one fp32 scale per block (uint8)
              gathered = wait(all_gather_into_tensor(slot))  # over the mesh dim the shard is split on
              full = quant_copy_out(gathered, ...)[0]        # dequantized straight into param_dtype
    backward: [cast to reduce_dtype] -> [zero-pad dim 0] -> [all_reduce over the replica dim (HYBRID)]
              -> reduce_scatter_tensor -> wait -> this rank's rows -> [cast to the master dtype]

The forward is exactly the form the bucketing pass gives a bucket (`passes/bucket.py`) for one member,
so the pass merges quantized gathers by concatenating their members; the ops are `kernels/quant_ops.py`
and the bytes `kernels/quantize.py` ([Note: quantized gathers] there: format and error bounds).

[Note: the gradient passes straight through]
Quantization has no useful derivative (it is a step function), so the gather is an autograd
`Function` whose backward is the reduction the unquantized gather's backward runs: the gradient of
the dequantized weight, reduced over the data-parallel mesh in `reduce_dtype` with the same reduce
op, lands on the master shard. The gradients are therefore those of the unquantized gather evaluated
at the dequantized weights (tested against a bf16 gather of those same weights). Masters, optimizer
state, checkpoints and `module.weight` outside the compiled step are untouched: only what travels the
all-gather is quantized, and it is recomputed from the full-precision master on every gather. A
quantized reduce-scatter is not offered: without error compensation its error accumulates in the
masters.

Where: in compiled steps only (`torch.compile`, where the gathers are traced and bucketed). Outside
one -- `module.weight` read in eager code, an eager forward, exports -- a gather is the unquantized
one (the master in `param_dtype`), so what a user inspects is the master, not its quantized image. Which
parameters: those sharded over exactly one mesh dim, on dim 0 (every sharding strategy's layout); a
replicated parameter (NO_SHARD, a 0-d one) is not gathered and keeps the plain path.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor, Shard

from simplefsdp._compat import c10d_functional
from simplefsdp.kernels import reference
from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT

__all__ = ["QuantizedGather", "gather_quantized", "quantizes"]

_CODE_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedGather:
    """How a parameter's gather is quantized: the code type (a `MixedPrecisionPolicy.gather_dtype`
    name) and the elements per block."""

    gather_dtype: str
    block: int

    @property
    def code_dtype(self) -> torch.dtype:
        return _CODE_DTYPES[self.gather_dtype]


def quantizes(param: DTensor) -> bool:
    """Whether a quantized gather applies to `param`: sharded on dim 0 over exactly one mesh dim."""
    shards = [p for p in param.placements if p.is_shard()]
    return len(shards) == 1 and shards[0] == Shard(0) and param.ndim > 0


def gather_quantized(
    param: DTensor,
    quant: QuantizedGather,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reduce_op: str,
) -> torch.Tensor:
    """The full local tensor of `param` (`quantizes(param)` holds) gathered as `quant` codes and
    dequantized into `param_dtype`, differentiable: its gradient is reduced in `reduce_dtype` with
    `reduce_op` over every mesh dim ([Note: the gradient passes straight through])."""
    mesh = param.device_mesh
    shard_dim = next(i for i, p in enumerate(param.placements) if p.is_shard())
    replica_groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim) if i != shard_dim)
    world = mesh.size(shard_dim)
    return _QuantizedGatherFn.apply(
        param.to_local(),
        _Layout(
            shape=tuple(param.shape),
            chunk=reference.chunk_numel(param.shape, world),
            world=world,
            group=mesh.get_group(shard_dim).group_name,
            replica_groups=replica_groups,
            code_dtype=quant.code_dtype,
            block=quant.block,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            master_dtype=param.dtype,
            reduce_op=reduce_op,
        ),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Layout:
    """Everything the gather and its backward need besides the shard (constants of the graph)."""

    shape: tuple[int, ...]
    chunk: int  # elements of one rank's padded shard
    world: int  # ranks of the sharded mesh dim
    group: str  # its process group's name
    replica_groups: tuple[str, ...]  # groups of the replicated mesh dims (HYBRID), reduced with all-reduce
    code_dtype: torch.dtype
    block: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_op: str


class _QuantizedGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: _Layout) -> torch.Tensor:
        ctx.layout, ctx.local_rows = layout, local.shape[0]
        slot = QUANT_COPY_IN([local], [layout.chunk], layout.code_dtype, layout.block)
        gathered = c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor(slot, layout.world, layout.group))
        shape = list(layout.shape)
        return QUANT_COPY_OUT(
            gathered, [layout.chunk], shape, [len(shape)], layout.world, layout.code_dtype, layout.block,
            layout.param_dtype,
        )[0]  # fmt: skip

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        layout: _Layout = ctx.layout
        grad = grad.to(layout.reduce_dtype).contiguous()
        rows = layout.shape[0]
        padded = layout.world * math.ceil(rows / layout.world)
        if padded != rows:
            grad = torch.constant_pad_nd(grad, [0, 0] * (grad.dim() - 1) + [0, padded - rows])
        for group in layout.replica_groups:  # first, as DTensor does: the same sums in the same order
            grad = c10d_functional.wait_tensor(c10d_functional.all_reduce(grad, layout.reduce_op, group))
        reduced = c10d_functional.wait_tensor(
            c10d_functional.reduce_scatter_tensor(grad, layout.reduce_op, layout.world, layout.group)
        )
        return reduced.narrow(0, 0, ctx.local_rows).to(layout.master_dtype), None
