"""A deterministic cost model: alpha-beta for collectives, a FLOP/byte roofline for compute.

    collective seconds = alpha + factor * (world - 1) / world * bytes_on_the_wire / bus_bandwidth
    compute seconds    = max(flops / peak_flops, bytes_read_and_written / memory_bandwidth)

`factor` is 1 for all-gather / reduce-scatter (ring, `bytes` the full gathered / reduced
buffer) and 2 for all-reduce. A profile may carry its own alpha and bandwidth per kind of
collective (a calibrated one does: each kind is measured on its own), and an `overlap`
efficiency: the share of a collective's time that really runs in parallel with compute (1 on a GPU
with a communication stream; on a small CPU host the communication threads take the cores the
compute uses, and the share is measured, see `simplefsdp calibrate`).

FLOPs come from `torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention); every
other op is memory bound, except those that move no data: views,
`getitem` (it picks one output of a multi-output op), a reshape of a contiguous tensor (a view),
and collectives (costed separately). Only the node's traced metadata is read, so a graph costs
the same in every run: the `auto` bucket plan and the inspection tools rely on it. The profiles
rank plans; they do not predict wall time to the microsecond.

[Note: where the profiles' numbers come from]
- compute and memory: dense BF16 peak and HBM bandwidth from NVIDIA's datasheets -- H100 SXM5
  989 TFLOP/s and 3.35 TB/s; H200 the same compute and 4.8 TB/s; A100 SXM4 80GB 312 TFLOP/s and
  2.0 TB/s;
- bus bandwidth: about 360 GB/s (H100 / H200) and 230 GB/s (A100), the all-gather / reduce-scatter
  bus bandwidth nccl-tests reports for 8 GPUs within an NVLink node (NVLink 4: 450 GB/s per
  direction, NVLink 3: 300 GB/s); 15 us per collective. Across nodes (InfiniBand at 400 Gb/s,
  50 GB/s per GPU) a ring runs slower, so at world sizes beyond 8 these are optimistic;
- "cpu-gloo": order-of-magnitude numbers for two processes on one small host over gloo's TCP
  loopback (100 us per collective, 2 GB/s, 50 GFLOP/s matmuls, 10 GB/s memory traffic, half of a
  collective's time hidden by compute), enough to rank bucket plans there; `simplefsdp calibrate`
  measures the machine at hand and writes a profile file, which every place that takes a profile
  name also takes (`profile(path)`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import fx

from simplefsdp._compat import flop_registry, tree_leaves
from simplefsdp.passes.collectives import Collective, is_communication, is_view_of_input
from simplefsdp.passes.liveness import sized_by_this_rank

__all__ = [
    "COLLECTIVE_KINDS",
    "PROFILES",
    "DeviceProfile",
    "collective_seconds",
    "compute_between",
    "node_seconds",
    "profile",
    "save_profile",
    "seconds_of",
]


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """The numbers the cost model charges with. Invariant: every rate is positive, `overlap` in [0, 1],
    `collectives` holds at most one `(kind, latency_s, bus_bytes_per_s)` per kind of `COLLECTIVE_KINDS`."""

    name: str
    latency_s: float  # alpha: fixed cost of one collective
    bus_bytes_per_s: float  # achievable collective bus bandwidth per rank
    flops_per_s: float  # dense matmul peak in the compute dtype
    memory_bytes_per_s: float  # device memory bandwidth
    overlap: float = 1.0  # share of a collective's time that runs in parallel with compute
    collectives: tuple[tuple[str, float, float], ...] = ()  # per kind: (kind, latency_s, bus_bytes_per_s)

    def __post_init__(self) -> None:
        rates = {k: getattr(self, k) for k in ("bus_bytes_per_s", "flops_per_s", "memory_bytes_per_s")}
        rates |= {f"{kind} bus_bytes_per_s": bw for kind, _, bw in self.collectives}
        bad = {k: v for k, v in rates.items() if not v > 0}
        if bad or self.latency_s < 0 or not 0.0 <= self.overlap <= 1.0:
            raise ValueError(
                f"device profile {self.name!r}: rates must be > 0, latency >= 0, overlap in [0, 1]: {self}"
            )
        unknown = [kind for kind, _, _ in self.collectives if kind not in COLLECTIVE_KINDS]
        if unknown or len({kind for kind, _, _ in self.collectives}) != len(self.collectives):
            raise ValueError(f"device profile {self.name!r}: collectives must be one each of {COLLECTIVE_KINDS}")

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency_s, bus_bytes_per_s) of one collective of `kind`."""
        return next(((a, b) for k, a, b in self.collectives if k == kind), (self.latency_s, self.bus_bytes_per_s))


def _profile(name: str, alpha: float, bus: float, flops: float, memory: float, overlap: float = 1.0) -> DeviceProfile:
    return DeviceProfile(
        name=name, latency_s=alpha, bus_bytes_per_s=bus, flops_per_s=flops, memory_bytes_per_s=memory, overlap=overlap
    )


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        _profile("h100", alpha=15e-6, bus=360e9, flops=989e12, memory=3.35e12),  # bf16 dense, NVLink
        _profile("h200", alpha=15e-6, bus=360e9, flops=989e12, memory=4.8e12),
        _profile("a100", alpha=15e-6, bus=230e9, flops=312e12, memory=2.0e12),
        # two processes on one host over gloo (TCP loopback): what the CPU tests and benchmark run
        _profile("cpu-gloo", alpha=100e-6, bus=2e9, flops=50e9, memory=10e9, overlap=0.5),
    )
}


def profile(name: str | Path) -> DeviceProfile:
    """The named profile of `PROFILES`, or the profile in a JSON file (what `simplefsdp calibrate` writes)."""
    if isinstance(name, str) and name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    raise ValueError(f"unknown device profile {name!r}; known: {sorted(PROFILES)}, or a profile .json file")


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from its JSON file; an error names the file and what is missing or wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(DeviceProfile)} - {"collectives"}
        missing = sorted(f for f in fields - {"overlap"} if f not in data)
        if missing:
            raise ValueError(f"missing keys {missing}")
        collectives = tuple(
            (kind, float(fit["latency_s"]), float(fit["bus_bytes_per_s"]))
            for kind, fit in sorted(data.get("collectives", {}).items())
        )
        numbers = {f: (data[f] if f == "name" else float(data[f])) for f in fields if f in data}
        return DeviceProfile(**numbers, collectives=collectives)
    except FileNotFoundError:
        raise ValueError(
            f"device profile file {str(path)!r} does not exist (write one with `simplefsdp calibrate`)"
        ) from None
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"device profile file {str(path)!r} is not a valid profile: {error}") from error


def save_profile(device: DeviceProfile, path: str | Path, *, extra: dict | None = None) -> None:
    """Write `device` as JSON (`extra`, e.g. the measurements it was fitted from, goes along unread)."""
    data = dataclasses.asdict(device)
    data["collectives"] = {kind: {"latency_s": a, "bus_bytes_per_s": b} for kind, a, b in device.collectives}
    Path(path).write_text(json.dumps({**data, **(extra or {})}, indent=1) + "\n")


def collective_seconds(device: DeviceProfile, *, kind: str, nbytes: int, world: int) -> float:
    """Seconds for one collective whose full buffer (gathered output / reduced input) has `nbytes`."""
    latency, bandwidth = device.alpha_beta(kind)
    if world <= 1:
        return latency
    factor = 2.0 if kind == "all_reduce" else 1.0
    return latency + factor * (world - 1) / world * nbytes / bandwidth


def seconds_of(device: DeviceProfile, collective: Collective) -> float:
    """`collective_seconds` of a traced collective: its full buffer over its group."""
    return collective_seconds(device, kind=collective.kind, nbytes=collective.full_nbytes, world=collective.group_size)


def _tensor_bytes(value: object) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _moves_no_data(node: fx.Node) -> bool:
    """Views, and collectives with their waits (a collective is costed by `seconds_of`, not as compute)."""
    return is_view_of_input(node) or is_communication(node)


def node_seconds(device: DeviceProfile, node: fx.Node) -> float:
    """Roofline seconds of one compute node (0 for placeholders, outputs and what moves no data)."""
    if node.op != "call_function" or "val" not in node.meta or _moves_no_data(node):
        return 0.0
    target = node.target
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    flops = 0
    formula = flop_registry.get(getattr(target, "overloadpacket", None))
    if formula is not None:
        flops = formula(*args[0], **args[1], out_val=node.meta["val"])
    moved = _tensor_bytes(args) + _tensor_bytes(node.meta["val"])
    return max(flops / device.flops_per_s, moved / device.memory_bytes_per_s)


def compute_between(device: DeviceProfile, graph: fx.Graph, marks: list[fx.Node]) -> list[float]:
    """Roofline seconds of the compute before, between and after `marks` (collectives, in graph
    order): `len(marks) + 1` stretches.

    Invariant: equal on every rank for the same program. Nodes sized by this rank's shards are
    left out: their cost differs by a few rows between ranks, and a plan built on these numbers
    (`plan_by_cost`) would otherwise pick different buckets on different ranks near a tie -- a hang.
    """
    skip, at = sized_by_this_rank(graph), set(marks)
    windows, current = [], 0.0
    for node in graph.nodes:
        if node in at:
            windows.append(current)
            current = 0.0
        elif node not in skip:
            current += node_seconds(device, node)
    windows.append(current)
    return windows
