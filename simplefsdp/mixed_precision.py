"""Mixed precision: which dtype the all-gather, the compute and the gradient reduction run in.

Invariants (for every policy):
- master parameters, their gradients and the optimizer state keep the dtype the parameter had
  before `wrap()` (normally fp32) -- except that a policy with `param_dtype` set makes the masters of
  parameters narrower than fp32 fp32 (see [Note: full-precision masters]);
- the all-gather runs in `param_dtype`, so the module computes with `param_dtype` weights;
- the gradient reduction (reduce-scatter / all-reduce) runs in `reduce_dtype`, then the reduced
  gradient is cast back to the master dtype.

[Note: full-precision masters]
A model loaded in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`) and trained under a bf16
policy would otherwise keep bf16 masters: the optimizer then adds each update to a bf16 weight, and
an update smaller than half a bf16 unit in the last place of the weight (about 2**-9 of it) is
rounded away, so training stalls at small learning rates. DeepSpeed keeps fp32 masters for this
reason, and Accelerate upcasts FSDP's sharded parameters when mixed precision is on. Asking for
mixed precision (`param_dtype` set) therefore means full-precision masters: `wrap()` casts each
bf16 / fp16 shard to fp32 once, after sharding (no rank ever holds a full fp32 copy), and logs how
many bytes per rank that adds. The compute still runs in `param_dtype`; gradients reach the masters
in fp32 and the optimizer builds its state in fp32 from them. Without a policy (or with
`param_dtype=None`) parameters keep the dtype they came in: pure bf16 training, with bf16 masters
and optimizer state, is a bf16 model wrapped without a policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from simplefsdp._compat import tree_map_only
from simplefsdp.settings import DEFAULT_GATHER_BLOCK, QUANTIZED_GATHER_DTYPES, check_gather_block

__all__ = ["QUANTIZED_GATHER_DTYPES", "MixedPrecisionPolicy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather / compute and for the gradient reduction.

    Args:
        param_dtype: dtype parameters are all-gathered and used in. `None`: the master dtype.
        reduce_dtype: dtype gradients are reduced in. `None`: `param_dtype` when that is set
            (what FSDP2 does), else the master dtype.
        output_dtype: if set, floating-point forward outputs of the wrapped model are cast to it.
        cast_forward_inputs: cast floating-point tensors passed to the wrapped model's forward
            to `param_dtype`, so a bf16 model can be fed fp32 inputs.
        gather_dtype: `"int8"` or `"float8_e4m3fn"`: the sharded parameters travel the all-gather
            as block-scaled codes of this type and are dequantized into `param_dtype` (lossy; see
            [Note: quantized gathers]). `None` (default): they travel in `param_dtype`.
        gather_block: elements per quantization block (one fp32 scale each), a power of two from
            8 to 8192; blocks start at each rank's shard of each parameter.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    gather_dtype: str | None = None
    gather_block: int = DEFAULT_GATHER_BLOCK

    def __post_init__(self) -> None:
        if self.gather_dtype is not None and self.gather_dtype not in QUANTIZED_GATHER_DTYPES:
            raise ValueError(
                f"MixedPrecisionPolicy.gather_dtype must be one of {', '.join(map(repr, QUANTIZED_GATHER_DTYPES))} "
                f"or None, got {self.gather_dtype!r}"
            )
        try:
            check_gather_block(self.gather_block)
        except ValueError as error:
            raise ValueError(f"MixedPrecisionPolicy.gather_block {error}") from None
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype, got {dtype!r}")

    def master_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the sharded master (and so of its gradient and optimizer state) of a parameter
        that came in as `dtype`: fp32 for one narrower than fp32 when `param_dtype` is set, else
        `dtype` (see [Note: full-precision masters])."""
        if self.param_dtype is not None and dtype.itemsize < torch.float32.itemsize:
            return torch.float32
        return dtype

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """dtype of the all-gathered (compute) parameter for a master of dtype `master`."""
        return self.param_dtype or master

    def reduction_dtype(self, master: torch.dtype) -> torch.dtype:
        """dtype the gradient of a master of dtype `master` is reduced in."""
        return self.reduce_dtype or self.param_dtype or master

    def install_casts(self, module: nn.Module) -> None:
        """Register the input/output casts on the root `module` (hooks trace under torch.compile)."""
        if self.cast_forward_inputs and self.param_dtype is not None:
            module.register_forward_pre_hook(_CastInputs(self.param_dtype), with_kwargs=True)
        if self.output_dtype is not None:
            module.register_forward_hook(_CastOutput(self.output_dtype))


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@dataclasses.dataclass(frozen=True)
class _CastInputs:
    """Forward pre-hook (with kwargs): casts floating-point positional and keyword inputs to `dtype`."""

    dtype: torch.dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floats((args, kwargs), self.dtype)


@dataclasses.dataclass(frozen=True)
class _CastOutput:
    """Forward hook: casts floating-point tensors in the output (any pytree) to `dtype`."""

    dtype: torch.dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floats(output, self.dtype)
