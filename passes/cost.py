"""A deterministic cost model: alpha-beta for collectives, a FLOP/byte roofline for compute.

    collective seconds = alpha + factor * (world - 1) / world * bytes_on_the_wire / bus_bandwidth
    compute seconds    = max(flops / peak_flops, bytes_read_and_written / memory_bandwidth)

`factor` is 1 for all-gather / reduce-scatter (ring, `bytes` the full gathered / reduced
buffer) and 2 for all-reduce. A profile may carry its own alpha and bandwidth per kind of
collective (a calibrated one does: each kind is measured on its own), and an `overlap`
efficiency: the share of a collective's time that really runs in parallel with compute (1 on a GPU
with a communication stream; on CPU ranks the communication threads take the cores the compute
uses, and the share is measured, see `simplefsdp calibrate`).

FLOPs come from `torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention); every
other op is memory bound, except those that move no data: views,
`getitem` (it picks one output of a multi-output op), a reshape of a contiguous tensor (a view),
and collectives (costed separately). Only the node's traced metadata is read, so a graph costs
the same in every run: the `auto` bucket plan and the inspection tools rely on it. The profiles
rank plans; they do not predict wall time to the microsecond.

[Note: where the profiles' numbers come from]
The named profiles (`PROFILES`: h100, h200, a100, a100-40gb, cpu-gloo) are read from `profiles.toml`,
each value with its source ([Note: the named profiles are data]): datasheet peaks for compute, memory
bandwidth and capacity; the bus bandwidth nccl-tests reports within one NVLink node for collectives
(optimistic across nodes, so beyond 8 ranks); round numbers of the right order for "cpu-gloo",
enough to rank bucket plans on CPU ranks. They charge none of [Note: what a training step adds]: no
wake-up, launch, copy-op call or per-collective step cost, a memory-bound optimizer step, and no
staging memory (NCCL's buffers live outside PyTorch's allocator). `simplefsdp calibrate` measures
all of it on the machine at hand and writes a profile file, which every place that takes a profile
name also takes (`profile(path)`).

[Note: what a training step adds]
What a training step pays that a collective timed back to back, or a roofline, does not show. All
nine terms are measured by `simplefsdp calibrate`; the named profiles leave them at zero / memory
bound (and compute at the roofline). The numbers quoted are one calibration of 2 gloo ranks on 2
CPU cores (bench/results/profile.json, its `measured` section).
- Compute as compiled: the roofline takes the rate of one large square matmul and of one large
  copy, each timed for a fraction of a second. On a shared CPU that matmul rate moves from one
  calibration to the next while the training steps do not, and a compiled forward and backward is
  not one large matmul. So calibration times a real one, the probe model compiled without sharding,
  against its roofline at the rates just measured, and `compute_scale` (measured / roofline: 1.17
  in the record) multiplies every node's roofline (`node_seconds`): what compiled compute runs at
  then comes from compiled compute, and a matmul timing caught in a slow moment cancels out of it.
  Measured on the CPU only: on a GPU a model that small times kernel launches, not throughput, and
  a scale taken from it would inflate every large model's compute.
- Wake-up and drift: a collective launched after its process group sat idle while compute ran
  costs more than one launched right after another (in the record, 0.23 ms more after 0.33 ms of
  matmuls, 2.2 ms more after 30 ms): a quick rise (the communication threads have to be scheduled
  again) and then a slow growth with the length of the compute (the ranks drift apart while they
  compute; the first to arrive waits for the other). The cost model charges `wake_s * (1 -
  exp(-idle / wake_tau_s)) + drift * compute` on top of alpha-beta, `idle` the time since the
  group's previous collective finished (unbounded for the first of a graph) and `compute` the
  compute since then (since the graph began for the first) (`wake_seconds`). A training step's
  stretches of compute between collectives run to tens of milliseconds, so calibration times
  stretches out to 32 ms, and the drift's charge stops growing at the longest stretch it measured
  (`drift_span_s`): a line is not extrapolated past its data. The extra flattens once a stretch
  spans a few of the scheduler's time slices (the ranks' jitter stops growing), so a line fitted to
  stretches of a few milliseconds would charge the long ones several times what they cost.
- The optimizer step: `seconds per parameter tensor * tensors + seconds per element * elements`,
  per optimizer (`optimizer_seconds`). The per-tensor term is what dominates small models: an
  eager optimizer over DTensor shards pays the DTensor dispatch for every op on every parameter (in
  the record, AdamW over 64 shards of 4,096 elements took 11 ms, where the memory-bound estimate
  says 0.25 ms).
- The launch: issuing a collective takes the calling thread a while before it returns to compute,
  time no overlap hides. Over gloo an asynchronous functional all-gather returns within 0.2 ms up
  to 16 MiB, a reduce-scatter after 0.08 ms at 4 KiB and 2.1 ms at 16 MiB (it copies its input
  first: the record); a graph without bucketing issues over a hundred collectives a step. `launch`
  holds, per kind, `seconds + seconds per byte * full buffer bytes`; the schedule advances the
  compute clock by it at each launch (`launch_seconds`). Back-to-back timings include it, so the
  collective's own alpha-beta time still starts at the launch.
- The copy ops' calls: a bucket's copy-in / copy-out (`kernels/copy_ops.py`) is one custom-op call
  that builds a tensor per member before any byte moves: the dispatcher, the checks, the outputs
  (and on a GPU the kernel's pointer table). On 8-element tensors an all-gather copy-in call took
  0.09 ms for one member and 0.18 ms for 16 (the record); the roofline sees only the bytes.
  `copy_ops` holds, per op, `seconds + seconds per member tensor`, charged on top of the op's
  roofline (`node_seconds`).
- Staging memory: a communication library may copy a collective's buffer while it runs. gloo
  all-gathers into a flat buffer of its own and copies out, and stages a reduce-scatter's input the
  same way: about one full buffer each (1.0 in the record), held from launch to wait. `staging`
  holds, per kind, those bytes per byte of the full buffer; the liveness walk adds them while the
  collective is in flight (`passes/liveness.py`).
- What is left per collective: a real compiled step still pays more per collective than all of the
  above charge (0.46 ms in the record). Calibration measures it last, on real compiled steps of a
  small model without and with the passes (`simplefsdp/calibrate/step_probe.py`, [Note: what a
  collective costs a step]); `step_collective_s` holds it, and the schedule charges it to the
  compute clock before each collective starts, on top whether the collective is hidden or exposed
  (`step_collective_seconds`), as time that is neither idle nor compute to the next collective's
  wake-up and drift (so a step gains what the fit charged and no more: [Note: the step terms add
  what was measured, no more] in `simplefsdp/inspect/schedule.py`; the same for the next term).
- What is left per wait right after a launch: with more ranks than cores, each rank that blocks on
  a collective it has just issued must wait for every other rank to be scheduled, which can cost
  tenths of a millisecond to milliseconds. The probe tells the two apart (the same buckets with and
  without reordering, per block and small), `step_exposed_wait_s` holds it, and the schedule adds it
  to the stall of each wait with no compute since its launch (`step_exposed_wait_seconds`).
- What is left per collective run behind compute: the same split can come out the other way. With
  gloo on one worker thread (`simplefsdp/gloo.py`), the probe's reordered plans can run slower than
  their unreordered twins (in the record, 63.4 against 61.8 ms and 133.6 against 130.6 ms, where the
  rest of the profile had them 8 and 15 ms faster): a collective whose transfer runs beside compute
  takes that compute's core for a while, beyond what the overlap share, measured on a loop of one
  bucket-sized gather, charges. A per-wait term would have to go negative to fit that;
  `step_hidden_s` holds it as a positive price per collective with compute between its launch and
  its wait, paid at that wait (`step_hidden_seconds`; 0.44 ms in the record). The two are one signed
  quantity (every collective is one or the other), so calibration fits at most one of them
  (`fit.fit_step_probe`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
from torch import fx

from simplefsdp._compat import flop_registry, tree_leaves
from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, REDUCE_SCATTER_COPY_IN
from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT
from simplefsdp.passes.collectives import Collective, is_communication, is_view_of_input
from simplefsdp.passes.liveness import sized_by_this_rank
from simplefsdp.passes.region_inputs import BODY_KEY

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

__all__ = [
    "COLLECTIVE_KINDS",
    "COPY_OPS",
    "OPTIMIZER_BYTES_PER_ELEMENT",
    "PROFILES",
    "PROFILES_FILE",
    "DeviceProfile",
    "collective_seconds",
    "compute_between",
    "copy_call_seconds",
    "launch_seconds",
    "node_seconds",
    "optimizer_seconds",
    "profile",
    "read_profiles",
    "save_profile",
    "seconds_of",
    "step_collective_seconds",
    "step_exposed_wait_seconds",
    "step_hidden_seconds",
    "wake_seconds",
]


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_COPY_OP_TARGETS = {
    ALL_GATHER_COPY_IN: "all_gather_copy_in",
    ALL_GATHER_COPY_OUT: "all_gather_copy_out",
    REDUCE_SCATTER_COPY_IN: "reduce_scatter_copy_in",
}
COPY_OPS = tuple(_COPY_OP_TARGETS.values())  # the bucket copy ops a profile may time the calls of
# the quantized gather's copy ops (`kernels/quant_ops.py`): one call a bucket like the plain gather's,
# charged that op's measured call (what a call costs before any byte moves: dispatch, checks, outputs);
# their bytes -- full-precision shards in, codes and scales out, and back -- go to the roofline as every op's
_COPY_OP_TARGETS |= {QUANT_COPY_IN: "all_gather_copy_in", QUANT_COPY_OUT: "all_gather_copy_out"}
# bytes read + written per fp32 sharded element by one optimizer step: SGD reads the grad and
# reads / writes the param and its momentum; AdamW reads / writes two moments
OPTIMIZER_BYTES_PER_ELEMENT = {"adamw": 4 + 8 + 16, "sgd": 4 + 8 + 8, "none": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """The numbers the cost model charges with. Invariant: every rate is positive, `overlap` in [0, 1],
    `collectives` holds at most one `(kind, latency_s, bus_bytes_per_s)` per kind of `COLLECTIVE_KINDS`,
    `optimizers` at most one `(name, seconds per tensor, seconds per element)` per optimizer of
    `OPTIMIZER_BYTES_PER_ELEMENT`, `launch` at most one `(kind, seconds, seconds per byte)` per kind,
    `copy_ops` at most one `(op, seconds, seconds per tensor)` per op of `COPY_OPS`, all >= 0;
    wake-up, launch, copy-op and optimizer terms: [Note: what a training step adds]."""

    name: str
    latency_s: float  # alpha: fixed cost of one collective
    bus_bytes_per_s: float  # achievable collective bus bandwidth per rank
    flops_per_s: float  # dense matmul peak in the compute dtype
    memory_bytes_per_s: float  # device memory bandwidth
    overlap: float = 1.0  # share of a collective's time that runs in parallel with compute
    capacity_bytes: float | None = None  # memory one rank may use (None: unknown)
    collectives: tuple[tuple[str, float, float], ...] = ()  # per kind: (kind, latency_s, bus_bytes_per_s)
    wake_s: float = 0.0  # extra latency of a collective after its group sat idle (saturated)
    wake_tau_s: float = 1e-3  # idle time at which the wake-up reaches 63% of `wake_s`
    drift: float = 0.0  # extra collective seconds per second of compute since the group's previous one
    drift_span_s: float | None = None  # the drift's charge stops at this much compute (None: no bound)
    optimizers: tuple[tuple[str, float, float], ...] = ()  # (name, tensor_s, element_s) per optimizer
    staging: tuple[tuple[str, float], ...] = ()  # (kind, bytes staged per byte of the full buffer)
    launch: tuple[tuple[str, float, float], ...] = ()  # (kind, seconds, seconds per full-buffer byte)
    copy_ops: tuple[tuple[str, float, float], ...] = ()  # (op, seconds per call, seconds per member tensor)
    step_collective_s: float = 0.0  # what else each collective costs a compiled step (measured in one)
    step_exposed_wait_s: float = 0.0  # what else waiting one with no compute since its launch costs (same)
    step_hidden_s: float = 0.0  # what else one with compute between its launch and its wait costs (same)
    compute_scale: float = 1.0  # wall seconds of compiled compute per roofline second (1: the roofline)
    backend: str = ""  # the communication backend it describes ("nccl", "gloo"; "": unknown), for dry runs
    # the host tier (offload, `simplefsdp/offload.py`); None: no host tier -- on a CPU the host is the device
    host_link_bytes_per_s: float | None = None  # host <-> device copies of pinned memory, one direction
    host_memory_bytes_per_s: float | None = None  # host memory bandwidth one rank's optimizer step reaches
    host_capacity_bytes: float | None = None  # host memory one rank may use

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
        if not self.compute_scale > 0:
            raise ValueError(f"device profile {self.name!r}: compute_scale must be > 0: {self}")
        if self.drift_span_s is not None and not self.drift_span_s > 0:
            raise ValueError(f"device profile {self.name!r}: drift_span_s must be > 0 or None: {self}")
        if self.capacity_bytes is not None and not self.capacity_bytes > 0:
            raise ValueError(f"device profile {self.name!r}: capacity_bytes must be > 0 or None: {self}")
        host = ("host_link_bytes_per_s", "host_memory_bytes_per_s", "host_capacity_bytes")
        if any(getattr(self, k) is not None and not getattr(self, k) > 0 for k in host):
            raise ValueError(f"device profile {self.name!r}: {', '.join(host)} must be > 0 or None: {self}")
        step = (self.step_collective_s, self.step_exposed_wait_s, self.step_hidden_s)
        if self.wake_s < 0 or not self.wake_tau_s > 0 or self.drift < 0 or min(step) < 0:
            raise ValueError(
                f"device profile {self.name!r}: wake_s, drift, step_collective_s, step_exposed_wait_s and "
                f"step_hidden_s must be >= 0 and wake_tau_s > 0: {self}"
            )
        names = [name for name, _, _ in self.optimizers]
        if len(set(names)) != len(names) or set(names) - set(OPTIMIZER_BYTES_PER_ELEMENT):
            raise ValueError(
                f"device profile {self.name!r}: optimizers must be at most one each of "
                f"{sorted(OPTIMIZER_BYTES_PER_ELEMENT)}, got {names}"
            )
        staged = [kind for kind, _ in self.staging]
        negative = any(factor < 0 for _, factor in self.staging)
        if len(set(staged)) != len(staged) or set(staged) - set(COLLECTIVE_KINDS) or negative:
            raise ValueError(
                f"device profile {self.name!r}: staging must be at most one factor >= 0 each of "
                f"{COLLECTIVE_KINDS}: {self.staging}"
            )
        launched = [kind for kind, _, _ in self.launch]
        if len(set(launched)) != len(launched) or set(launched) - set(COLLECTIVE_KINDS):
            raise ValueError(f"device profile {self.name!r}: launch must be at most one each of {COLLECTIVE_KINDS}")
        if any(a < 0 or b < 0 for _, a, b in self.launch):
            raise ValueError(f"device profile {self.name!r}: launch seconds must be >= 0: {self.launch}")
        ops = [op for op, _, _ in self.copy_ops]
        if len(set(ops)) != len(ops) or set(ops) - set(COPY_OPS) or any(a < 0 or b < 0 for _, a, b in self.copy_ops):
            raise ValueError(
                f"device profile {self.name!r}: copy_ops must be at most one each of {COPY_OPS}, "
                f"seconds >= 0: {self.copy_ops}"
            )
        if any(t < 0 or e < 0 for _, t, e in self.optimizers):
            raise ValueError(f"device profile {self.name!r}: optimizer seconds must be >= 0: {self.optimizers}")

    def staging_factor(self, kind: str) -> float:
        """Bytes the communication library stages per byte of a `kind` collective's full buffer."""
        return next((factor for k, factor in self.staging if k == kind), 0.0)

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency_s, bus_bytes_per_s) of one collective of `kind`."""
        return next(((a, b) for k, a, b in self.collectives if k == kind), (self.latency_s, self.bus_bytes_per_s))


# [Note: the named profiles are data]
# The named profiles' numbers live in `profiles.toml` beside this module (package data), each with
# the datasheet, published benchmark, result record or assumption it comes from, so a number and its
# source change together and the code holds none. Each profile is a table of `DeviceProfile` fields,
# each `{ value = ..., source = "..." }`; a value without a source is refused at import.
PROFILES_FILE = Path(__file__).with_name("profiles.toml")


def _sourced_values(table: object, *, where: str) -> dict[str, object]:
    """The `DeviceProfile` fields of one profile's table, each entry `{ value = ..., source = "..." }`."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table of DeviceProfile fields, got {table!r}")
    fields = {f.name for f in dataclasses.fields(DeviceProfile)} - {"name"}
    values = {}
    for key, entry in table.items():
        if key not in fields:
            raise ValueError(f"{where} {key}: not a DeviceProfile field; known: {sorted(fields)}")
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            raise ValueError(f'{where} {key}: must be {{ value = ..., source = "..." }}, got {entry!r}')
        if not isinstance(entry["source"], str) or not entry["source"].strip():
            raise ValueError(f"{where} {key}: the source must say where the value comes from, got {entry['source']!r}")
        values[key] = entry["value"]
    return values


def read_profiles(path: str | Path) -> dict[str, DeviceProfile]:
    """The profiles of a data file in `profiles.toml`'s format, by name; an error names the file and key."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"device profiles file {str(path)!r}: {error}") from error
    profiles = {}
    for name, table in document.items():
        where = f"device profiles file {str(path)!r}: [{name}]"
        values = _sourced_values(table, where=where)
        try:
            profiles[name] = DeviceProfile(name=name, **values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error
    return profiles


PROFILES: dict[str, DeviceProfile] = read_profiles(PROFILES_FILE)


def profile(name: str | Path) -> DeviceProfile:
    """The named profile of `PROFILES`, or the profile in a JSON file (what `simplefsdp calibrate` writes)."""
    if isinstance(name, str) and name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    raise ValueError(f"unknown device profile {name!r}; known: {sorted(PROFILES)}, or a profile .json file")


# The profile's `(name, first, second)` fields and, per field, the JSON keys of `first` and `second`.
_NESTED = {
    "collectives": ("latency_s", "bus_bytes_per_s"),
    "optimizers": ("tensor_s", "element_s"),
    "launch": ("seconds", "seconds_per_byte"),
    "copy_ops": ("seconds", "seconds_per_tensor"),
}


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from its JSON file; an error names the file and what is missing or wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        nested = {*_NESTED, "staging"}
        fields = {f.name for f in dataclasses.fields(DeviceProfile)} - nested
        optional = {"overlap", "wake_s", "wake_tau_s", "drift", "drift_span_s", "capacity_bytes"}
        optional |= {"step_collective_s", "step_exposed_wait_s", "step_hidden_s", "compute_scale", "backend"}
        optional |= {"host_link_bytes_per_s", "host_memory_bytes_per_s", "host_capacity_bytes"}
        missing = sorted(f for f in fields - optional if f not in data)
        if missing:
            raise ValueError(f"missing keys {missing}")
        triples = {
            field: tuple((name, float(fit[a]), float(fit[b])) for name, fit in sorted(data.get(field, {}).items()))
            for field, (a, b) in _NESTED.items()
        }
        staging = tuple((kind, float(factor)) for kind, factor in sorted(data.get("staging", {}).items()))
        text = ("name", "backend")
        numbers = {f: (str(data[f]) if f in text else float(data[f])) for f in fields if data.get(f) is not None}
        return DeviceProfile(**numbers, **triples, staging=staging)
    except FileNotFoundError:
        raise ValueError(
            f"device profile file {str(path)!r} does not exist (write one with `simplefsdp calibrate`)"
        ) from None
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"device profile file {str(path)!r} is not a valid profile: {error}") from error


def save_profile(device: DeviceProfile, path: str | Path, *, extra: dict | None = None) -> None:
    """Write `device` as JSON (`extra`, e.g. the measurements it was fitted from, goes along unread)."""
    data = dataclasses.asdict(device)
    for field, (a, b) in _NESTED.items():
        data[field] = {name: {a: first, b: second} for name, first, second in getattr(device, field)}
    data["staging"] = dict(device.staging)
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


def launch_seconds(device: DeviceProfile, *, kind: str, nbytes: int) -> float:
    """Seconds the calling thread spends issuing a collective of `kind` whose full buffer has `nbytes`
    before it returns to compute ([Note: what a training step adds]; 0 where the profile has not
    measured it)."""
    seconds, per_byte = next(((a, b) for k, a, b in device.launch if k == kind), (0.0, 0.0))
    return seconds + per_byte * nbytes


def step_collective_seconds(device: DeviceProfile) -> float:
    """Seconds each collective costs a compiled step beyond its time, launch, copy calls and wake-up
    ([Note: what a training step adds]; 0 where the profile has not measured it)."""
    return device.step_collective_s


def step_exposed_wait_seconds(device: DeviceProfile) -> float:
    """Seconds a compiled step pays, beyond the stall, to wait a collective with no compute since its
    launch ([Note: what a training step adds]; 0 where the profile has not measured it)."""
    return device.step_exposed_wait_s


def step_hidden_seconds(device: DeviceProfile) -> float:
    """Seconds a compiled step pays, at the wait, for a collective with compute between its launch and
    its wait, beyond what the overlap share charges ([Note: what a training step adds]; 0 where the
    profile has not measured it)."""
    return device.step_hidden_s


def copy_call_seconds(device: DeviceProfile, *, op: str, tensors: int) -> float:
    """Seconds one call of the copy op `op` (of `COPY_OPS`) over `tensors` member tensors costs beyond
    its bytes ([Note: what a training step adds]; 0 where the profile has not measured it)."""
    seconds, per_tensor = next(((a, b) for name, a, b in device.copy_ops if name == op), (0.0, 0.0))
    return seconds + per_tensor * tensors


def _copy_call_seconds(device: DeviceProfile, node: fx.Node) -> float:
    op = _COPY_OP_TARGETS.get(node.target)
    if op is None or not device.copy_ops:
        return 0.0
    members = node.meta["val"] if op == "all_gather_copy_out" else node.args[0]  # outputs / input list
    return copy_call_seconds(device, op=op, tensors=len(members))


def wake_seconds(device: DeviceProfile, *, idle_s: float, compute_s: float) -> float:
    """Extra seconds of a collective launched `idle_s` after its group's previous one finished
    (`math.inf`: the first of a graph), with `compute_s` of compute since then
    ([Note: what a training step adds])."""
    wake = device.wake_s * -math.expm1(-idle_s / device.wake_tau_s) if idle_s > 0.0 else 0.0
    stretch = max(0.0, compute_s)
    if device.drift_span_s is not None:
        stretch = min(stretch, device.drift_span_s)
    return wake + device.drift * stretch


def optimizer_seconds(device: DeviceProfile, *, optimizer: str, tensors: int, elements: int) -> float:
    """Seconds of one step of `optimizer` over `tensors` parameter shards of `elements` elements in all:
    measured per tensor and per element where the profile has them, else memory bound."""
    if optimizer not in OPTIMIZER_BYTES_PER_ELEMENT:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_BYTES_PER_ELEMENT)}")
    measured = next(((t, e) for name, t, e in device.optimizers if name == optimizer), None)
    if measured is None:
        return elements * OPTIMIZER_BYTES_PER_ELEMENT[optimizer] / device.memory_bytes_per_s
    return tensors * measured[0] + elements * measured[1]


def _tensor_bytes(value: object) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _moves_no_data(node: fx.Node) -> bool:
    """Views, and collectives with their waits (a collective is costed by `seconds_of`, not as compute)."""
    return is_view_of_input(node) or is_communication(node)


def _attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, matmuls: int) -> int:
    """FLOPs of `matmuls` attention-sized matmuls: each of q @ k^T, p @ v and the backward's
    re-computed scores and three gradients is 2 * batch * query heads * s_q * s_k * head dim
    (grouped-query attention: every query head attends, so query heads count)."""
    batch, heads, s_q, head_dim = query.shape
    return matmuls * 2 * batch * heads * s_q * key.shape[-2] * max(head_dim, value.shape[-1])


# [Note: attention on the CPU]
# The CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward, what
# inductor's graphs call on the CPU) has no formula in torch's FLOP registry, whose flash entries are
# the CUDA kernels'. Without one, a CPU graph's attention cost only its bytes, so a CPU step's
# predicted time left attention's matmuls out. The
# forward is two attention-sized matmuls, the backward five (scores re-computed, then the gradients of
# the probabilities, values, queries and keys). Arguments: (query, key, value, ...), and for the
# backward (grad_out, query, key, value, ...).
def _cpu_attention_forward_flops(query, key, value, *args, **kwargs) -> int:
    return _attention_flops(query, key, value, matmuls=2)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return _attention_flops(query, key, value, matmuls=5)


_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_forward_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def counts_flops(node: fx.Node) -> bool:
    """A matmul, convolution or attention: an op with a FLOP formula (torch's registry, or
    [Note: attention on the CPU])."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet in flop_registry or packet in _CPU_ATTENTION


def node_flops(node: fx.Node, values: tuple[tuple, dict] | None = None) -> int:
    """FLOPs of one node (0 for an op without a formula, see `counts_flops`); `values`: its
    (args, kwargs) with nodes replaced by their values, if the caller has them already."""
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) or _CPU_ATTENTION.get(packet)
    if formula is None or "val" not in node.meta:
        return 0
    if values is None:
        values = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    args, kwargs = values
    return formula(*args, **kwargs, out_val=node.meta["val"])


def node_seconds(device: DeviceProfile, node: fx.Node) -> float:
    """Roofline seconds of one compute node (0 for placeholders, outputs and what moves no data) times
    the profile's `compute_scale`, plus a bucket copy op's call overhead where the profile measured it
    (`copy_call_seconds`)."""
    if BODY_KEY in node.meta:  # a region's call (`region_inputs.note_region_bodies`): its body's nodes
        return sum(node_seconds(device, inner) for inner in node.meta[BODY_KEY].graph.nodes)
    if node.op != "call_function" or "val" not in node.meta or _moves_no_data(node):
        return 0.0
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    moved = _tensor_bytes(args) + _tensor_bytes(node.meta["val"])
    roofline = max(node_flops(node, args) / device.flops_per_s, moved / device.memory_bytes_per_s)
    return roofline * device.compute_scale + _copy_call_seconds(device, node)


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
