"""Mixed precision: which dtype the all-gather, the compute and the gradient reduction run in.

Invariants (for every policy):
- master parameters, their gradients and the optimizer state keep the dtype the parameter had
  before `wrap()` (normally fp32);
- the all-gather runs in `param_dtype`, so the module computes with `param_dtype` weights;
- the gradient reduction (reduce-scatter / all-reduce) runs in `reduce_dtype`, then the reduced
  gradient is cast back to the master dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from simplefsdp._compat import tree_map_only

__all__ = ["MixedPrecisionPolicy"]


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
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype, got {dtype!r}")

    def gather_dtype(self, master: torch.dtype) -> torch.dtype:
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
