"""The schedule view: when each collective runs against the compute, per the cost model.

[Note: the two-stream model]
A GPU runs a compiled graph on a compute stream and its collectives on one communication stream
per process group. `simulate` replays a post-pass graph in node order with
`passes/cost.py` (the same model the `auto` bucket plan uses):
- a compute node advances the compute clock by its roofline seconds;
- a collective launch starts when both the compute clock has reached it and its group's stream
  is free, and lasts its alpha-beta seconds, plus the profile's wake-up for the time the stream sat
  idle before it (the first collective of a graph: saturated) and its drift for the compute since
  the stream's previous collective; the launch itself also holds the compute clock for the
  profile's launch seconds, the calling thread's time to issue it; and before it starts, the compute
  clock pays what else a collective costs a compiled step (`step_collective_s`), exposed or not
  (see [Note: what a training step adds] in `passes/cost.py`);
- a wait stalls the compute clock until its collective has finished; that stall is the
  collective's *exposed* time; a wait with no compute since the launch also stalls for what else
  such a wait costs a compiled step (`step_exposed_wait_s`, same note), a wait with compute since
  the launch what else a collective run behind compute costs one (`step_hidden_s`); no step term
  counts as idle time or compute to a later wake-up ([Note: the step terms add what was measured,
  no more]);
- where communication does not fully run in parallel with compute (a profile's `overlap` below 1:
  on a small CPU host, the communication threads take the compute's cores), the time a collective
  ran behind compute costs the compute clock `(1 - overlap)` of it at the wait, counted as exposed.
A collective is "overlapped" if its wait never stalls (within 1% of its duration), "exposed" if
no compute runs between its launch and its wait, "partly exposed" otherwise. Step time is the
forward, then the backward, then the optimizer update of this rank's shards
(`cost.optimizer_seconds`: measured per tensor and per element in a calibrated profile, memory
bound otherwise).

Invariant: the result depends only on the graph and the profile (never on timing), so it is
the same on every rank and every run.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import torch
from torch import fx

from simplefsdp._compat import module_fqn
from simplefsdp.blocks import block_of, find_repeated_blocks
from simplefsdp.inspect.live_bytes import local_shard
from simplefsdp.passes import cost
from simplefsdp.passes.collectives import Collective, is_bucket_copy, is_wait, parse_collective

__all__ = [
    "CommEvent",
    "ComputeSpan",
    "PhaseSchedule",
    "StepSchedule",
    "simulate",
    "simulate_step",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeSpan:
    """Consecutive compute of one module group (a repeated block, or a top-level module)."""

    start_s: float
    end_s: float
    label: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommEvent:
    phase: str
    name: str  # launch node
    collective: str
    lane: str  # process group name: collectives of one group run one after another
    nbytes: int  # full buffer bytes (what the alpha-beta model charges)
    launch_s: float  # compute clock at the launch
    start_s: float  # when the stream is free for it
    end_s: float
    wait_s: float  # compute clock when its wait is reached (before any stall)
    exposed_s: float  # stall at the wait
    launched_before: str  # the first compute after the launch ("module op")
    waited_before: str  # the first compute after the wait: what needs the result
    compute_between_s: float  # roofline seconds of compute between launch and wait
    matmuls_between: int  # compute nodes with FLOPs (matmuls, attention) between launch and wait

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def status(self) -> str:
        if self.compute_between_s == 0.0:
            return "exposed"
        return "overlapped" if self.exposed_s <= 0.01 * self.duration_s else "partly exposed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseSchedule:
    phase: str
    start_s: float
    end_s: float
    compute: tuple[ComputeSpan, ...]
    comm: tuple[CommEvent, ...]
    stalls: tuple[tuple[float, float], ...]  # compute waiting on communication

    @property
    def exposed_s(self) -> float:
        return sum(end - start for start, end in self.stalls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSchedule:
    device: cost.DeviceProfile
    forward: PhaseSchedule
    backward: PhaseSchedule
    optimizer_s: float

    @property
    def step_s(self) -> float:
        return self.backward.end_s + self.optimizer_s

    @property
    def exposed_s(self) -> float:
        return self.forward.exposed_s + self.backward.exposed_s

    @property
    def exposed_pct(self) -> float:
        return 100.0 * self.exposed_s / self.step_s if self.step_s else 0.0

    @property
    def comm(self) -> tuple[CommEvent, ...]:
        return self.forward.comm + self.backward.comm


def _label(node: fx.Node) -> str:
    op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return f"{module_fqn(node) or '(root)'} {op}"


def _group(node: fx.Node, blocks: list[str]) -> str:
    if is_bucket_copy(node):
        return "fsdp copies"
    path = module_fqn(node)
    block = block_of(path, blocks)
    return block if block is not None else (path.split(".")[0] or "(root)")


@dataclasses.dataclass
class _Launch:
    collective: Collective
    start_s: float
    end_s: float
    launch_s: float
    issue_s: float = 0.0  # compute-clock seconds the launch itself took (`cost.launch_seconds`)
    launched_before: str = ""
    compute_s: float = 0.0
    matmuls: int = 0
    wait: tuple[float, float, str] | None = None  # (wait clock, stall, waited before)


def _close_span(spans: list[ComputeSpan], start: float, end: float, label: str) -> None:
    if end > start:
        spans.append(ComputeSpan(start_s=start, end_s=end, label=label))


# [Note: the step terms add what was measured, no more]
# Calibration fits `step_collective_s`, `step_exposed_wait_s` and `step_hidden_s` as what real steps
# took beyond the schedule's prediction without them (`fit.fit_step_probe`): `a` per collective, `b`
# per wait right after its launch and `c` per collective with compute before its wait, added to that
# prediction. The replay must charge them the same way, or the fit
# does not carry over: were their seconds idle time of the group's stream, the next collective's
# wake-up and drift would grow with them, and a step of `N` collectives would gain more than
# `a * N` -- by how much depending on the compute between collectives, so by model (on the 2-core
# host the benchmarks' no-passes row gained 0.27 ms per collective from a fitted 0.15 ms, and came
# out 17% over its measured step where the same profile's probe had fitted it). So the seconds they
# charge are kept apart (`_Charged`) and are neither idle time nor compute to `cost.wake_seconds`.


class _Charged:
    """The compute-clock intervals the step terms charged, in clock order (disjoint, each ending at
    or before the clock at any later query)."""

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._total = [0.0]  # seconds charged before each interval

    def add(self, start: float, seconds: float) -> None:
        if seconds > 0.0:
            self._starts.append(start)
            self._ends.append(start + seconds)
            self._total.append(self._total[-1] + seconds)

    def within(self, since: float) -> float:
        """Seconds charged from `since` up to now."""
        first = bisect.bisect_right(self._ends, since)  # the first interval ending after `since`
        if first == len(self._ends):
            return 0.0
        return self._total[-1] - self._total[first] - max(0.0, since - self._starts[first])


def simulate(
    graph: fx.Graph, *, device: cost.DeviceProfile, phase: str, start_s: float = 0.0, blocks: list[str] = ()
) -> PhaseSchedule:
    """Replay `graph` on the two-stream model of [Note: the two-stream model], from `start_s`."""
    clock, stream_free, charged = start_s, {}, _Charged()
    spans, stalls, pending, done = [], [], {}, []
    span_start, span_label, waiting_for_compute = clock, None, []
    for node in graph.nodes:
        collective = parse_collective(node)
        if collective is not None:
            lane = collective.group_name
            free = stream_free.get(lane, -math.inf)
            since = max(free, start_s)  # [Note: the step terms add what was measured, no more]
            idle, compute = clock - free - charged.within(free), clock - since - charged.within(since)
            charged.add(clock, cost.step_collective_seconds(device))  # before it starts: hidden or exposed
            clock += cost.step_collective_seconds(device)
            begin = max(clock, free)
            extra = cost.wake_seconds(device, idle_s=idle, compute_s=compute)
            end = begin + cost.seconds_of(device, collective) + extra
            stream_free[lane] = end
            issue = cost.launch_seconds(device, kind=collective.kind, nbytes=collective.full_nbytes)
            pending[node] = _Launch(collective=collective, start_s=begin, end_s=end, launch_s=clock, issue_s=issue)
            waiting_for_compute.append(("launch", pending[node]))
            clock += issue  # the calling thread issues it before it computes again
        elif is_wait(node) and node.args[0] in pending:
            launch = pending[node.args[0]]
            hidden = max(0.0, min(launch.end_s, clock) - max(launch.start_s, launch.launch_s + launch.issue_s))
            stall = max(0.0, launch.end_s - clock) + (1.0 - device.overlap) * hidden
            # waited with no compute since its launch ("exposed"), or run behind compute: what
            # else each costs a step, paid at the wait ([Note: what a training step adds])
            if launch.compute_s == 0.0:
                term = cost.step_exposed_wait_seconds(device)
            else:
                term = cost.step_hidden_seconds(device)
            charged.add(clock + stall, term)
            stall += term
            if stall:
                _close_span(spans, span_start, clock, span_label)
                stalls.append((clock, clock + stall))
                span_start = clock + stall
            launch.wait = (clock, stall, "")
            waiting_for_compute.append(("wait", launch))
            clock += stall
            done.append(launch)
        else:
            seconds = cost.node_seconds(device, node)
            if seconds <= 0:
                continue
            label = _group(node, list(blocks))
            if label != span_label:
                _close_span(spans, span_start, clock, span_label)
                span_start, span_label = clock, label
            if not is_bucket_copy(node):  # name the model's compute, not the bucket plumbing
                for what, launch in waiting_for_compute:
                    if what == "launch":
                        launch.launched_before = _label(node)
                    else:
                        launch.wait = (*launch.wait[:2], _label(node))
                waiting_for_compute = []
            for launch in pending.values():
                if launch.wait is None:
                    launch.compute_s += seconds
                    launch.matmuls += cost.counts_flops(node)
            clock += seconds
    _close_span(spans, span_start, clock, span_label)
    events = tuple(_event(phase, launch) for launch in pending.values() if launch.wait is not None)
    return PhaseSchedule(
        phase=phase, start_s=start_s, end_s=clock, compute=tuple(spans), comm=events, stalls=tuple(stalls)
    )


def _event(phase: str, launch: _Launch) -> CommEvent:
    collective = launch.collective
    wait_s, stall, waited_before = launch.wait
    return CommEvent(
        phase=phase,
        name=collective.launch.name,
        collective=collective.kind,
        lane=collective.group_name,
        nbytes=collective.full_nbytes,
        launch_s=launch.launch_s,
        start_s=launch.start_s,
        end_s=launch.end_s,
        wait_s=wait_s,
        exposed_s=stall,
        launched_before=launch.launched_before or "(end of graph)",
        waited_before=waited_before or "(end of graph)",
        compute_between_s=launch.compute_s,
        matmuls_between=launch.matmuls,
    )


def simulate_step(
    forward: fx.Graph,
    backward: fx.Graph,
    *,
    device: cost.DeviceProfile,
    model: torch.nn.Module,
    optimizer: str = "adamw",
) -> StepSchedule:
    """Forward, then backward, then the optimizer update of this rank's shards of `model`."""
    trainable = [local_shard(p) for p in model.parameters() if p.requires_grad]
    optimizer_s = cost.optimizer_seconds(
        device, optimizer=optimizer, tensors=len(trainable), elements=sum(t.numel() for t in trainable)
    )
    blocks = find_repeated_blocks(model)
    fwd = simulate(forward, device=device, phase="forward", blocks=blocks)
    bwd = simulate(backward, device=device, phase="backward", start_s=fwd.end_s, blocks=blocks)
    return StepSchedule(device=device, forward=fwd, backward=bwd, optimizer_s=optimizer_s)
