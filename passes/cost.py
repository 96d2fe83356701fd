"""A deterministic cost model: alpha-beta for collectives, a FLOP/byte roofline for compute.

    collective seconds = alpha + factor * (world - 1) / world * bytes_on_the_wire / bus_bandwidth
    compute seconds    = max(flops / peak_flops, bytes_read_and_written / memory_bandwidth)

`factor` is 1 for all-gather / reduce-scatter (ring, `bytes` the full gathered / reduced
buffer) and 2 for all-reduce. FLOPs come from `torch.utils.flop_counter`'s formulas (matmuls,
convolutions, attention); every other op is memory bound, except those that move no data: views,
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
  loopback (100 us per collective, 2 GB/s, 50 GFLOP/s matmuls, 10 GB/s memory traffic), enough to
  rank bucket plans there; `bench/inspect_validate.py` measures a calibrated profile of the
  machine at hand for predictions.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from simplefsdp._compat import flop_registry, tree_leaves
from simplefsdp.passes.collectives import (
    Collective,
    is_communication,
    is_data_movement,
    is_reduce_scatter,
    is_view_of_input,
    is_wait,
)

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "collective_seconds",
    "compute_between",
    "node_seconds",
    "profile",
    "seconds_of",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    name: str
    latency_s: float  # alpha: fixed cost of one collective
    bus_bytes_per_s: float  # achievable collective bus bandwidth per rank
    flops_per_s: float  # dense matmul peak in the compute dtype
    memory_bytes_per_s: float  # device memory bandwidth


def _profile(name: str, alpha: float, bus: float, flops: float, memory: float) -> DeviceProfile:
    return DeviceProfile(name=name, latency_s=alpha, bus_bytes_per_s=bus, flops_per_s=flops, memory_bytes_per_s=memory)


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        _profile("h100", alpha=15e-6, bus=360e9, flops=989e12, memory=3.35e12),  # bf16 dense, NVLink
        _profile("h200", alpha=15e-6, bus=360e9, flops=989e12, memory=4.8e12),
        _profile("a100", alpha=15e-6, bus=230e9, flops=312e12, memory=2.0e12),
        # two processes on one host over gloo (TCP loopback): what the CPU tests and benchmark run
        _profile("cpu-gloo", alpha=100e-6, bus=2e9, flops=50e9, memory=10e9),
    )
}


def profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {sorted(PROFILES)}") from None


def collective_seconds(device: DeviceProfile, *, kind: str, nbytes: int, world: int) -> float:
    """Seconds for one collective whose full buffer (gathered output / reduced input) has `nbytes`."""
    if world <= 1:
        return device.latency_s
    factor = 2.0 if kind == "all_reduce" else 1.0
    return device.latency_s + factor * (world - 1) / world * nbytes / device.bus_bytes_per_s


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


def _sized_by_this_rank(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose tensors may have rank-dependent sizes (a smaller shard of an unevenly sharded
    parameter): data movement from graph inputs -- a shard's casts, pads and bucket copy-in on its
    way to an all-gather -- and everything downstream of a reduce-scatter's wait (this rank's
    gradient shard). Every other tensor -- gathered parameters, activations, full gradients -- has
    the same size on every rank."""
    prep, scattered = set(), set()
    for node in graph.nodes:  # graph order: a node's inputs come before it
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if is_data_movement(node) and inputs and all(i.op == "placeholder" or i in prep for i in inputs):
            prep.add(node)
        if any(i in scattered or (is_wait(i) and is_reduce_scatter(i.args[0])) for i in inputs):
            scattered.add(node)
    return prep | scattered


def compute_between(device: DeviceProfile, graph: fx.Graph, marks: list[fx.Node]) -> list[float]:
    """Roofline seconds of the compute before, between and after `marks` (collectives, in graph
    order): `len(marks) + 1` stretches.

    Invariant: equal on every rank for the same program. Nodes sized by this rank's shards are
    left out: their cost differs by a few rows between ranks, and a plan built on these numbers
    (`plan_by_cost`) would otherwise pick different buckets on different ranks near a tie -- a hang.
    """
    skip, at = _sized_by_this_rank(graph), set(marks)
    windows, current = [], 0.0
    for node in graph.nodes:
        if node in at:
            windows.append(current)
            current = 0.0
        elif node not in skip:
            current += node_seconds(device, node)
    windows.append(current)
    return windows
