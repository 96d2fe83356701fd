"""Does a configuration fit? The dry run's peak against the device's memory, with the peak's parts.

    verdict = memory_verdict(result, margin=0.1)
    verdict.fits, verdict.line(), verdict.parts

[Note: the safety margin]
The peak is a prediction (`inspect/memory.py` says what it counts and ignores: allocator
fragmentation and caching, library workspaces). A configuration "fits" when its predicted peak
stays below `(1 - margin)` of the capacity; between that and the capacity it "fits only without
the margin", a warning, not a yes. The default margin is 10%, the tolerance the peak prediction is
validated to (`bench/inspect_validate.py`).

With an offload tier (`offload_cost.py`) the peak counts what stays on the device, and the bytes in
host memory are checked against the host's capacity per rank (`host_capacity_bytes` of the
profile, or given) with the same margin: a host that cannot hold its share does not fit either.

The parts are the peak's composition, per rank: the persistent state (sharded parameters and
optimizer state), then the transient peak split by the liveness walk into gradients reduced so
far, gathered parameters and communication buffers in flight (the bucket copy buffers, the
gathered buckets, the communication library's staging where the profile measured it), and
activations (saved for backward and intermediate). The hint names the largest lever. With tensor
parallelism the walk cannot tell a sequence-parallel all-gather of activations from FSDP's gather
of weights: both count as gathered / communication buffers.
"""

from __future__ import annotations

import dataclasses

from simplefsdp.inspect.dryrun import DryRunResult
from simplefsdp.passes.liveness import ACTIVATIONS, COMM_BUFFERS, REDUCED_GRADIENTS

__all__ = ["MemoryVerdict", "memory_verdict"]

GIB = 2**30
PARAMETERS = "sharded parameters"
OPTIMIZER = "optimizer state"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryVerdict:
    """The peak per rank against the capacity. Invariant: `fits` implies `peak_bytes <= (1 - margin)
    * capacity_bytes`; without a known capacity, `fits` is None."""

    device: str
    capacity_bytes: float | None
    peak_bytes: int
    margin: float
    parts: dict[str, int]  # what the peak is made of (PARAMETERS, OPTIMIZER, and the walk's kinds)
    hint: str
    host_bytes: int = 0  # in host memory per rank (an offload tier)
    host_capacity_bytes: float | None = None

    @property
    def host_fits(self) -> bool | None:
        """Whether host memory holds its share with the margin (True without offload; None: unknown)."""
        if not self.host_bytes:
            return True
        if self.host_capacity_bytes is None:
            return None
        return self.host_bytes <= (1.0 - self.margin) * self.host_capacity_bytes

    @property
    def fits(self) -> bool | None:
        if self.capacity_bytes is None or self.host_fits is None:
            return None
        return self.peak_bytes <= (1.0 - self.margin) * self.capacity_bytes and self.host_fits

    @property
    def headroom_bytes(self) -> float | None:
        """Capacity minus peak (negative: over by that much)."""
        return None if self.capacity_bytes is None else self.capacity_bytes - self.peak_bytes

    def host_line(self) -> str:
        """The host's share, e.g. `12.34 GiB/rank offloaded to host memory (of 232.83 GiB)`; empty without offload."""
        if not self.host_bytes:
            return ""
        of = "" if self.host_capacity_bytes is None else f" (of {self.host_capacity_bytes / GIB:,.2f} GiB)"
        return f"{self.host_bytes / GIB:,.2f} GiB/rank offloaded to host memory{of}"

    def line(self) -> str:
        line = self._device_line()
        if not self.host_bytes:
            return line
        if self.host_fits is None:
            return f"{line}; {self.host_line()}, host capacity unknown: no verdict (give one)"
        if not self.host_fits:
            return f"does not fit: host memory cannot hold {self.host_line()} with the {self.margin:.0%} margin"
        return f"{line}; {self.host_line()}"

    def _device_line(self) -> str:
        peak = f"peak {self.peak_bytes / GIB:,.2f} GiB/rank"
        if self.capacity_bytes is None:
            return f"no verdict: the profile {self.device!r} has no memory capacity ({peak}); give one"
        capacity = f"{self.device} ({self.capacity_bytes / GIB:,.2f} GiB)"
        if self.peak_bytes <= (1.0 - self.margin) * self.capacity_bytes:
            return f"fits on {capacity}: {peak}, {self.headroom_bytes / GIB:,.2f} GiB free"
        if self.headroom_bytes >= 0:
            return (
                f"fits on {capacity} only without the {self.margin:.0%} safety margin: {peak}, "
                f"{self.headroom_bytes / GIB:,.2f} GiB free; {self.hint}"
            )
        return f"does not fit on {capacity}: {peak}, over by {-self.headroom_bytes / GIB:,.2f} GiB; {self.hint}"


def _hint(parts: dict[str, int], result: DryRunResult) -> str:
    largest = max(parts, key=parts.get)
    if largest == ACTIVATIONS:
        if result.ac == "none":
            return "activations are the largest part: try activation checkpointing (--ac full) or a smaller micro-batch"
        return "activations are the largest part: try a smaller micro-batch or sequence"
    if largest in (PARAMETERS, OPTIMIZER, REDUCED_GRADIENTS):
        offload = "" if result.offload == "all" else ", or offload to host memory (--offload)"
        return (
            f"{largest} is the largest part: shard over more ranks, FULL_SHARD, or tensor parallelism (--tp){offload}"
        )
    return f"{largest} is the largest part: smaller buckets, prefetch depth 0, or a memory budget"


def memory_verdict(
    result: DryRunResult,
    *,
    margin: float = 0.1,
    capacity_bytes: float | None = None,
    host_capacity_bytes: float | None = None,
) -> MemoryVerdict:
    """The verdict on `result` for its profile's capacities (or `capacity_bytes` / `host_capacity_bytes`,
    which override them)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    capacity = capacity_bytes if capacity_bytes is not None else result.device.capacity_bytes
    if capacity is not None and not capacity > 0:
        raise ValueError(f"device memory capacity must be > 0 bytes, got {capacity!r}")
    parts = {
        PARAMETERS: result.persistent.params_bytes,
        OPTIMIZER: result.persistent.optimizer_bytes,
        REDUCED_GRADIENTS: result.transient_parts.get(REDUCED_GRADIENTS, 0),
        COMM_BUFFERS: result.transient_parts.get(COMM_BUFFERS, 0),
        ACTIVATIONS: result.transient_parts.get(ACTIVATIONS, 0),
    }
    return MemoryVerdict(
        device=result.device.name,
        capacity_bytes=capacity,
        peak_bytes=result.peak_bytes,
        margin=margin,
        parts=parts,
        hint=_hint(parts, result),
        host_bytes=result.host_bytes,
        host_capacity_bytes=host_capacity_bytes
        if host_capacity_bytes is not None
        else result.device.host_capacity_bytes,
    )
