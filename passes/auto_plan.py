"""The `auto` bucket plan: buckets and prefetch depth from the cost model, under a memory budget.

For the all-gathers of a graph it weighs two schedules and keeps the one the cost model predicts
exposes less communication:

- prefetch depth 0: no gather runs behind compute; each costs its whole time, so the fewest, largest
  buckets win (latency), up to a cap;
- prefetch depth 1: each bucket is gathered during the previous bucket's compute (`plan_by_cost`),
  so smaller buckets can hide -- as far as the profile's `overlap` says compute and communication
  really run side by side.

[Note: what the memory budget buys]
`BucketConfig.memory_budget` bounds the bytes the pass may add to a graph's peak. Gathered buckets
are what grows it: with prefetch depth `d`, `d + 1` gathered buckets live at once, so a bucket may
gather at most `budget / (d + 1)` bytes (each rank sends that over the group size). A reduction
bucket lives as its gradients and, while in flight, as its input: at most `budget / 2`. A tight
budget thus gives smaller buckets and makes depth 1 pay for its overlap with more, smaller
collectives; a loose one lets the cheaper schedule take few large buckets. The reordering that
follows gets the chosen depth, and checks the peak itself (`reorder.py`, [Note: the memory budget]).

[Note: what a bucket costs whatever overlaps it]
Issuing a collective holds the calling thread (`cost.launch_seconds`), each collective costs a
compiled step what calibration measured beyond that (`cost.step_collective_seconds`), and a bucket
of two or more members adds its copy ops' calls (`cost.copy_call_seconds`: copy-in and copy-out for
a gather, copy-in for a reduction); no overlap hides any of these. At prefetch depth 0 each gather
is also waited right after its launch (at depth 1 only the first), which calibration may have
measured a price for (`cost.step_exposed_wait_seconds`); at depth 1 the others, and the reductions
(waited after later compute), run behind compute, which it may have priced instead
(`cost.step_hidden_seconds`; a profile prices one of the two). Where the profile measured them,
the plan charges them per bucket (`bucket_fixed_seconds`), so many small buckets pay for their
count, as they do in the dry run's schedule; a named profile measures none of them, and the plan is
then the same as without.

Invariant: a pure function of the graph, the profile and the budget -- the same on every rank.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from simplefsdp.passes import cost
from simplefsdp.passes.backend import reduces_in_place
from simplefsdp.passes.collectives import Collective
from simplefsdp.passes.plan import Bucket, Candidate, MergeKey, exposed_seconds, plan_by_cost

__all__ = ["AutoPlan", "bucket_fixed_seconds", "plan_auto"]

PREFETCH_DEPTHS = (0, 1)  # the schedules weighed (plan_by_cost models depth 1; deeper is not modelled)


def bucket_fixed_seconds(device: cost.DeviceProfile, *, key: MergeKey, nbytes: int, members: int) -> float:
    """Seconds one bucket of `members` collectives of `key`, each rank sending `nbytes` in all, costs
    the step whatever runs beside it ([Note: what a bucket costs whatever overlaps it])."""
    gather = key.kind == "all_gather"
    seconds = cost.launch_seconds(device, kind=key.kind, nbytes=nbytes * key.group_size if gather else nbytes)
    seconds += cost.step_collective_seconds(device)
    if members < 2:  # a lone collective keeps its own cast / pad nodes: no copy op
        return seconds
    ops = ("all_gather_copy_in", "all_gather_copy_out") if gather else ("reduce_scatter_copy_in",)
    return seconds + sum(cost.copy_call_seconds(device, op=op, tensors=members) for op in ops)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoPlan:
    buckets: list[Bucket]
    prefetch_depth: int | None  # for all-gathers; None for reductions
    exposed_s: float  # predicted exposed communication, the buckets' fixed costs included


def plan_auto(
    graph: fx.Graph,
    found: list[Collective],
    candidates: list[Candidate],
    *,
    device: cost.DeviceProfile,
    cap_bytes: int,
    budget_bytes: int | None,
) -> AutoPlan:
    """The auto plan of `candidates` (made from `found`, collectives of `graph`, in graph order)."""
    windows = cost.compute_between(device, graph, [c.launch for c in found]) if found else [0.0]
    # what each key's bucket will issue, decided once (the plan's dynamic program asks per run it
    # weighs): on gloo a reduce-scatter bucket all-reduces in place (`passes/backend.py`)
    issued = {
        c.key: "all_reduce" if c.key.kind == "reduce_scatter" and reduces_in_place(c.key.group_name) else c.key.kind
        for c in candidates
    }

    def comm_s(key: MergeKey, nbytes: int) -> float:
        full = nbytes * key.group_size if key.kind == "all_gather" else nbytes
        return cost.collective_seconds(device, kind=issued[key], nbytes=full, world=key.group_size)

    def plan(windows_s: list[float], cap: int, *, waited_at_launch: bool = False) -> tuple[list[Bucket], float]:
        waited = cost.step_exposed_wait_seconds(device) if waited_at_launch else cost.step_hidden_seconds(device)

        def fixed_s(key: MergeKey, nbytes: int, members: int) -> float:
            return bucket_fixed_seconds(device, key=key, nbytes=nbytes, members=members) + waited

        model = {"windows_s": windows_s, "comm_s": comm_s, "overlap": device.overlap, "fixed_s": fixed_s}
        buckets = plan_by_cost(candidates, cap_bytes=cap, **model)
        return buckets, exposed_seconds(candidates, buckets, **model)

    world = max((c.key.group_size for c in candidates), default=1)
    if not candidates or candidates[0].key.kind != "all_gather":
        cap = cap_bytes if budget_bytes is None else max(1, min(cap_bytes, budget_bytes // 2))
        buckets, exposed = plan(windows, cap)
        return AutoPlan(buckets=buckets, prefetch_depth=None, exposed_s=exposed)
    best = None
    for depth in PREFETCH_DEPTHS:
        cap = cap_bytes if budget_bytes is None else max(1, min(cap_bytes, budget_bytes // (depth + 1) // world))
        buckets, exposed = plan(windows if depth else [0.0] * len(windows), cap, waited_at_launch=not depth)
        if depth and buckets:  # the first gather has nothing to run behind: waited right after its launch
            exposed += cost.step_exposed_wait_seconds(device) - cost.step_hidden_seconds(device)
        if best is None or exposed < best.exposed_s:  # a tie keeps the shallower, cheaper in memory
            best = AutoPlan(buckets=buckets, prefetch_depth=depth, exposed_s=exposed)
    return best
