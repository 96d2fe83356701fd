"""What one step asks of the process group, read from `torch.profiler`: how many collective calls,
and how many bytes its all-gathers gather.

[Note: one counter for eager hooks and compiled code]
FSDP2's hooks call the process group from Python; a compiled simplefsdp step calls it from
inductor's generated code. Both end in the process group's own calls, which the profiler records as
events named after the backend (`gloo:all_gather`, `nccl:all_reduce`, ...) with the shape and dtype
of the tensor each rank contributes when shapes are recorded. Counting those events, and their
bytes, is the one counter that sees every row alike: the bytes are this rank's input times the
number of ranks, the size of the gathered tensor (padding and quantization scales included, as
they travel), never a figure derived from the model's parameter sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from simplefsdp import gloo

__all__ = ["StepCollectives", "count_step_collectives", "dtype_bytes"]

# the profiler's names of the dtypes a collective may carry -> bytes per element
_DTYPE_BYTES = {
    "double": 8,
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}


@dataclasses.dataclass(frozen=True)
class StepCollectives:
    """One step's process-group calls on this rank.

    Invariant: `gathered_bytes` is 0 when no call was an all-gather."""

    calls: int
    gathered_bytes: int  # sum over the all-gathers of the gathered tensor's bytes (input x ranks)


def dtype_bytes(name: str) -> int:
    """Bytes per element of the profiler's dtype name `name` (e.g. "c10::BFloat16": 2)."""
    if name not in _DTYPE_BYTES:
        raise ValueError(f"collective tensor of dtype {name!r}: its size is unknown; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _input_bytes(shapes: list, dtypes: list) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes, strict=False):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            total += dtype_bytes(dtype) * int(torch.Size(shape).numel())
    return total


def count_step_collectives(step: Callable[[], None]) -> StepCollectives:
    """Run `step` once under `torch.profiler` and count its process-group calls and the bytes its
    all-gathers gathered on this rank ([Note: one counter for eager hooks and compiled code])."""
    backend = dist.get_backend()
    prefix = "gloo" if gloo.is_gloo(backend) else backend  # a one-worker gloo group's events say "gloo:"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    calls = gathered = 0
    for event in prof.events():
        if not event.name.startswith(f"{prefix}:"):
            continue
        calls += 1
        if "all_gather" in event.name or "allgather" in event.name:
            gathered += _input_bytes(event.input_shapes, event.input_dtypes) * dist.get_world_size()
    return StepCollectives(calls=calls, gathered_bytes=gathered)
