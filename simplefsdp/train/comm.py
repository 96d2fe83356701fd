"""The one-line communication summary of a compiled training step: buckets and overlap.

    # simplefsdp.inspect.record.recording, simplefsdp.passes.install.pass_of
    with recording(pass_of(model)) as graphs:   # around the first (compiling) call of the step
        loss_fn(compiled(batch)).backward()
    summary = summarize(model, graphs, profile=cost.profile("cpu-gloo"))
    print(summary.line())   # comm: 10 collectives/step (from 58 traced), 81% overlapped (cost model 'cpu-gloo'),
                            # transient peak 30.1 MiB (from 26.3 traced)

[Note: what the numbers are]
- *collectives/step*: the collective launches (all-gather, reduce-scatter, all-reduce; TP's too) in
  the forward and backward graphs as simplefsdp's pass left them; "from N traced" counts them in
  the same graphs before the pass. Exact: the graphs are what inductor compiles.
- *overlapped*: the share of communication time that runs behind compute, from the two-stream
  replay of `simplefsdp.inspect.schedule` with the cost model's device profile. It is an estimate
  from the graph's order and alpha-beta / roofline costs, not a measurement (nothing on a CPU
  exposes per-collective timing without slowing the step); it says how much the schedule *can*
  hide, and is 0% when every collective is waited right after launch. The profile is the one the run
  plans with (`--profile`: a name or a `simplefsdp calibrate` file);
- *transient peak*: the larger of the forward's and the backward's peak live bytes by the liveness
  walk of `simplefsdp.passes.liveness` (the one the pass checks its memory budget with and
  `simplefsdp inspect` reports), after the pass and, in brackets, before it: what the pass costs in
  memory. Graph-level: allocator caching and communication libraries' buffers are not in it.
Eager runs trace nothing: the summary says so instead of guessing.
"""

from __future__ import annotations

import dataclasses

from torch import fx, nn

from simplefsdp.inspect.record import StepGraphs
from simplefsdp.inspect.schedule import simulate_step
from simplefsdp.passes import cost
from simplefsdp.passes.collectives import is_collective
from simplefsdp.passes.liveness import graph_peak

__all__ = ["CommSummary", "summarize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommSummary:
    """See [Note: what the numbers are]. `overlapped_pct` is None when it cannot be estimated."""

    traced: bool
    collectives: int = 0
    collectives_before_pass: int = 0
    overlapped_pct: float | None = None
    profile: str = ""
    peak_bytes: int = 0
    peak_bytes_before_pass: int = 0
    from_cache: bool = False  # untraced because the compile cache served the step, with no summary of it

    def line(self) -> str:
        if self.from_cache:
            return "comm: the step's graphs came from the compile cache, which holds no summary of them"
        if not self.traced:
            return "comm: eager mode, collectives issued one per parameter use (nothing traced to bucket or count)"
        text = f"comm: {self.collectives} collectives/step (from {self.collectives_before_pass} traced)"
        if self.overlapped_pct is not None:
            text += f", {self.overlapped_pct:.0f}% overlapped (cost model '{self.profile}')"
        mib = 2**20
        return (
            text
            + f", transient peak {self.peak_bytes / mib:.1f} MiB (from {self.peak_bytes_before_pass / mib:.1f} traced)"
        )


def _count(graphs: list[fx.Graph]) -> int:
    return sum(is_collective(node) for graph in graphs for node in graph.nodes)


def _peak(graphs: list[fx.Graph], profile: cost.DeviceProfile) -> int:
    staging = dict(profile.staging)  # the communication library's own buffers, where the profile measured them
    return max((graph_peak(graph, staging=staging).peak_bytes for graph in graphs), default=0)


def summarize(model: nn.Module, graphs: StepGraphs | None, *, profile: cost.DeviceProfile) -> CommSummary:
    """Counts over every recorded graph; overlap when they are one forward and one backward."""
    if graphs is None or not graphs.post:
        return CommSummary(traced=False)
    overlapped = None
    if len(graphs.post) == 2:
        schedule = simulate_step(graphs.post[0], graphs.post[1], device=profile, model=model)
        total = sum(event.duration_s for event in schedule.comm)
        exposed = sum(min(event.exposed_s, event.duration_s) for event in schedule.comm)
        overlapped = 100.0 * (1.0 - exposed / total) if total else 0.0
    return CommSummary(
        traced=True,
        collectives=_count(graphs.post),
        collectives_before_pass=_count(graphs.pre),
        overlapped_pct=overlapped,
        profile=profile.name,
        peak_bytes=_peak(graphs.post, profile),
        peak_bytes_before_pass=_peak(graphs.pre, profile),
    )
