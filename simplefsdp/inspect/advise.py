"""The advisor: which configuration to run -- the fastest predicted one that fits with a margin.

    advice = advise("llama3-70b", world_size=64, device="h100", tp=(1, 8))
    advice.winner.choice, advice.winner.result.step_s, advice.rows   # ranked, best first

It searches sharding strategy (FULL_SHARD re-gathers in backward, SHARD_GRAD_OP keeps the
gathered weights unless checkpointing recomputes them; with a `shard_size`, the two HYBRID
strategies too) x activation checkpointing (none, selective, full) x tensor-parallel degree (those
asked for) x what simplefsdp's pass does (no passes; one bucket per block with prefetch depth 0, 1
or 2; the cost model's `auto` plan, which picks buckets and depth itself, without and with a memory
budget of 0.25) x what lives in host memory (no offload, the "optimizer" tier, "all"; where the
profile has a host tier), costs each with the dry run's models (`schedule.py`, the liveness walk, the
device profile; an offload tier priced on the trace without it, [Note: pricing the host tier] in
`offload_cost.py`) and ranks them: offloading is slower, so it wins only where less does not fit.

[Note: trace once, re-cost many]
Only the first three axes change the graphs torch traces (reshard or keep, recompute or save,
which collectives tensor parallelism adds), so each of their combinations is traced once (at
two or three depths for a deep shape, see [Note: a steady state to extrapolate from]) with the pass off,
and the pre-pass graphs are kept. Every pass variant is then the real `FsdpPass` -- built for the
traced model and mesh exactly as `wrap()` builds it (`simplefsdp.wrap.make_pass`) -- run on a copy
of those graphs: the graphs the compiler would have produced, without compiling again. (The test
suite checks that re-costing the default pass gives the same step time and peak as a trace with
the pass on.)

[Note: pruning by a lower bound]
Some configurations cannot fit whatever the trace says: each rank holds at least its parameter
shards and optimizer state (what the lightest offload tier searched leaves of them on the device),
and under SHARD_GRAD_OP / HYBRID_SHARD_ZERO2 without activation checkpointing also every gathered
parameter from its forward to its backward (at least the model's parameter count over the
tensor-parallel degree, in the gather dtype). (With
checkpointing the gathers sit inside the recomputed region and are gathered again in backward:
the traced peaks show it, so no such bound holds there.) When the bound alone exceeds the
device's memory, the configuration is listed as not fitting, with the bound, and not traced.

[Note: a steady state to extrapolate from]
A deep shape's rows are extrapolated from traces at 5 and 6 blocks (see [Note: tracing a few
blocks and extrapolating] in `dryrun.py`, which traces 4 and 5 for the default pass). The search
needs the extra depth: with prefetch depth 2 the backward's gathered buffers of an
activation-checkpointed Llama-3-70B grow by 1.6 GiB from 4 to 5 blocks and by nothing from 5 to
6, and the auto plan's buckets can span two blocks, so one added block need not add a block's
worth. Where a row fits by that extrapolation, its configuration may also be traced at 4 blocks
(see [Note: checking only what can win]), and a row whose extrapolation from (4, 5) disagrees with
the one from (5, 6) by more than 10% in step time or peak is marked unsteady: shown, never ranked
as fitting. A configuration none of whose rows fits is not traced at 4 blocks: no check could make
it fit (its rows show steadiness "not checked").

[Note: checking only what can win]
A check changes no number -- the rows stay extrapolated from (5, 6) -- it only marks rows steady or
not, and only a steady row can win. So the configurations with a fitting row are checked in the
order of the best rank one of their rows could take, two at a time (`CHECK_BATCH`: a fixed number,
so that which rows are checked does not depend on the workers), and the checks stop once a
checked steady row ranks before everything an unchecked configuration could offer: the winner is
then the one a check of every configuration would have found. The unchecked configurations' rows
that fit are ranked after the checked ones that fit ("fits, not checked"), before the rest; for
Llama-3-8B at world 64, one round of two checks in place of six.

[Note: the search's rounds]
The work is cut into tasks small enough to keep every worker busy (`workers.py`): first the
persistent memory of each (strategy, TP) pair, which decides the pruning; then one task per
configuration and traced depth -- trace, then re-cost every pass variant on that depth's graphs,
sending back numbers, not graphs; last, the 4-block traces of the configurations that have a row
that fits, best first, until the winner is decided ([Note: checking only what can win]). A round
waits for the one before it; the tasks of a round run in any order and their results are put back
in the search's order, so the rows are the same with any number of workers.

[Note: ranking]
Rows that fit with the margin (and are steady) come first, most tokens per second over the world
first -- not the shortest step: a step with tensor parallelism of degree t trains t times fewer
sequences on the same GPUs (a factory model's tokens are unknown; it has no TP and its step time
decides). Then the rows that fit but were not checked (in the same order; [Note: checking only what
can win]), then the rest, smallest peak first. Ties keep the search's fixed order (`Choice.order`:
TP, strategy, AC, pass variant), so the ranking is a pure function of the traced graphs, the
profile, the capacity and the margin: the same answer every time, in any number of processes.

[Note: lossy gathers, on request]
A quantized gather (`MixedPrecisionPolicy.gather_dtype`) changes the numbers the model computes
with, so the advice never picks one unasked: the search runs in the policy's gather dtype (in
`param_dtype` unless it names a code type). `gathers` widens it -- each configuration also traced
with the quantized gather, its rows ranked with the rest, so it wins where it is fastest -- at
twice the traces. Without that, `lossy_alternative` prices the winner's configuration once more
with quantized gathers (traced again at the depths the search traced it, priced at its offload
tier) and keeps it beside the ranking (`Advice.lossy`), not in it: what the lossy option would
buy, for one more configuration's traces.

MFU counts model FLOPs per token as 6 x parameters + 12 x layers x width x sequence (weights
forward and backward, and attention scores; recomputation not counted), over the profile's dense
peak `flops_per_s`; named shapes only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import simplefsdp
from simplefsdp.inspect.choice import PASS_VARIANTS, Choice
from simplefsdp.inspect.dryrun import (
    AC_POLICIES,
    Costed,
    DryRunResult,
    Traced,
    TraceSettings,
    check_shard_size,
    depths,
    estimate,
    full_depth_persistent,
    meshes,
    result_of,
    trace_depth,
)
from simplefsdp.inspect.memory import Persistent, check_optimizer, persistent_bytes
from simplefsdp.inspect.offload_cost import check_tier, copy_fraction, reshards, with_offload
from simplefsdp.inspect.record import StepGraphs
from simplefsdp.inspect.report import Report, analyse, resolve_profile
from simplefsdp.inspect.shapes import ModelShape, check_batch_and_seq, model_shape
from simplefsdp.inspect.verdict import MemoryVerdict, memory_verdict
from simplefsdp.inspect.workers import Workers
from simplefsdp.offload import TIERS
from simplefsdp.passes import cost
from simplefsdp.passes.fsdp_pass import FsdpPass
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.wrap import make_pass

__all__ = ["PASS_VARIANTS", "Advice", "Choice", "Row", "advise", "rank_rows", "recost"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One costed (or pruned) configuration. `result` is None when pruned by the lower bound
    (`bound_bytes`, see [Note: pruning by a lower bound])."""

    choice: Choice
    verdict: MemoryVerdict
    result: DryRunResult | None = None
    bound_bytes: int | None = None
    mfu: float | None = None
    steady: bool | None = True  # see [Note: a steady state to extrapolate from]; None: not checked

    @property
    def fits(self) -> bool:
        """Fits with the margin, by a prediction the advisor trusts (steady, see the notes)."""
        return bool(self.verdict.fits) and self.steady is True

    @property
    def pruned(self) -> bool:
        return self.result is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Advice:
    """The ranked rows (see [Note: ranking]); `winner` is the first if it fits, else None."""

    model: str
    world_size: int
    device: cost.DeviceProfile
    capacity_bytes: float
    margin: float
    rows: tuple[Row, ...]
    traces: int  # configurations the search traced (at one depth, or at two or three to extrapolate)
    recosts: int  # pass variants the search re-costed on traced graphs
    search_s: float
    lossy: Row | None = None  # the winner with quantized gathers ([Note: lossy gathers, on request])

    @property
    def winner(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None


def recost(
    report: Report, graph_pass: FsdpPass | None, *, device: cost.DeviceProfile, optimizer: str = "adamw"
) -> Report:
    """`report`'s step as `graph_pass` would have compiled it: the pass run on copies of the recorded
    pre-pass graphs (None: no pass), analysed on `device`. See [Note: trace once, re-cost many]."""
    graphs = report.capture.graphs
    forward, backward = graphs.forward_pre, graphs.backward_pre  # read only, unless a pass runs on copies
    if graph_pass is not None:
        forward, backward = copy.deepcopy(forward), copy.deepcopy(backward)
        graph_pass(forward)
        graph_pass(backward)
    post = StepGraphs(pre=[graphs.forward_pre, graphs.backward_pre], post=[forward, backward])
    capture = dataclasses.replace(report.capture, graphs=post)
    return analyse(capture, device=device, optimizer=optimizer, buckets=False)  # the advisor ranks, shows no tables


def _model_flops_per_token(shape: ModelShape, *, params: int, seq: int) -> float:
    return 6.0 * params + 12.0 * shape.args.n_layers * shape.args.dim * seq


def _keeps_gathered(strategy: ShardingStrategy) -> bool:
    return strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)


def _lower_bound(
    persistent_total: int, *, params: int, strategy: ShardingStrategy, ac: str, tp: int, itemsize: int
) -> int:
    """Bytes per rank no run of this configuration can go below (see [Note: pruning by a lower bound])."""
    if not (_keeps_gathered(strategy) and ac == "none"):
        return persistent_total
    return persistent_total + params * itemsize // tp


def _strategies(shard_size: int | None) -> tuple[ShardingStrategy, ...]:
    base = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
    if shard_size is None:
        return base
    return (*base, ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def _check(world_size: int, tp: Sequence[int], ac: Sequence[str], capacity: float | None, device: str) -> None:
    bad_tp = [t for t in tp if not isinstance(t, int) or t < 1 or world_size % t]
    if bad_tp or not tp:
        raise ValueError(f"tp degrees must be positive integers dividing the world size {world_size}, got {list(tp)}")
    unknown = [a for a in ac if a not in AC_POLICIES]
    if unknown or not ac:
        raise ValueError(f"unknown activation checkpointing {unknown or list(ac)}; known: {', '.join(AC_POLICIES)}")
    if capacity is None:
        raise ValueError(f"the profile {device!r} has no memory capacity: the advisor needs one (--device-memory-gib)")
    if not capacity > 0:
        raise ValueError(f"device memory must be > 0 bytes, got {capacity!r}")


def advise(
    model: str | ModelShape | Callable[[], tuple[nn.Module, Any]],
    *,
    world_size: int,
    device: str | cost.DeviceProfile = "h100",
    tp: Sequence[int] = (1,),
    ac: Sequence[str] = AC_POLICIES,
    strategies: Sequence[ShardingStrategy | str] | None = None,
    shard_size: int | None = None,
    mp_policy: simplefsdp.MixedPrecisionPolicy | None = None,
    batch: int | None = None,
    seq: int | None = None,
    optimizer: str = "adamw",
    margin: float = 0.1,
    capacity_bytes: float | None = None,
    max_traced_blocks: int = 8,
    jobs: int = 1,
    on_progress: Callable[[str], None] | None = None,
    offload: Sequence[str] | None = None,
    host_capacity_bytes: float | None = None,
    gathers: Sequence[str | None] | None = None,
    lossy_alternative: str | None = None,
) -> Advice:
    """Search the configurations of the module docstring for `model` at `world_size` ranks on
    `device` and rank them. `capacity_bytes` overrides the profile's memory; `margin` is the fits
    verdict's safety margin; `strategies` (default: FULL_SHARD and SHARD_GRAD_OP, and the HYBRID
    pair with a `shard_size`) restricts the search; `jobs` > 1 runs that many tasks (a trace at one
    depth and its re-costs) at once in worker processes (named shapes; see [Note: worker processes]
    in `workers.py`); `on_progress(message)` is called as each task finishes. `offload`: the tiers of
    `simplefsdp.offload.TIERS` to search (default: all of them where the profile has a host tier, else
    none); `host_capacity_bytes` overrides the profile's host memory per rank. `gathers`: the gather
    dtypes to search (None for gathers in `param_dtype`, or one of `QUANTIZED_GATHER_DTYPES`;
    default: the policy's); `lossy_alternative`: a code type to price the winner with as well, when
    no quantized gather was searched ([Note: lossy gathers, on request])."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    check_batch_and_seq(batch=batch, seq=seq)
    profile = resolve_profile(device)
    check_optimizer(optimizer)
    has_host = profile.host_link_bytes_per_s is not None and profile.host_memory_bytes_per_s is not None
    tiers = tuple(offload) if offload is not None else (TIERS if has_host else ("none",))
    if not tiers:
        raise ValueError(f"offload: give at least one tier to search of {', '.join(TIERS)}")
    for tier in tiers:
        check_tier(profile, tier)
    capacity = capacity_bytes if capacity_bytes is not None else profile.capacity_bytes
    _check(world_size, tp, ac, capacity, profile.name)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if tuple(tp) != (1,) and not isinstance(model, (str, ModelShape)):
        raise ValueError("tp > 1 needs a named shape (a factory's model has no tensor-parallel plan here)")
    if mp_policy is None:
        mp_policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gathers = tuple(dict.fromkeys((mp_policy.gather_dtype,) if gathers is None else gathers))
    policies = [dataclasses.replace(mp_policy, gather_dtype=gather) for gather in gathers]  # ValueError if unknown
    if not policies:
        raise ValueError("gathers: give at least one gather dtype to search (None: in param_dtype)")
    if lossy_alternative is not None:
        dataclasses.replace(mp_policy, gather_dtype=lossy_alternative)  # ValueError if unknown
    shape = model_shape(model) if isinstance(model, str) else model
    name = shape.name if isinstance(shape, ModelShape) else getattr(model, "__name__", type(model).__name__)
    tokens = shape.example_input(batch=batch, seq=seq).numel() if isinstance(shape, ModelShape) else None
    params = sum(p.numel() for p in shape.build().parameters()) if isinstance(shape, ModelShape) else None  # meta
    flops_per_token = None if params is None else _model_flops_per_token(shape, params=params, seq=seq or shape.seq)
    searched = _strategies(shard_size) if strategies is None else tuple(map(ShardingStrategy.parse, strategies))
    for strategy in searched:  # before any trace
        check_shard_size(strategy=strategy, world_size=world_size, shard_size=shard_size)
    started = time.perf_counter()
    common = dict(
        shape=shape,
        name=name,
        world_size=world_size,
        shard_size=shard_size,
        batch=batch,
        seq=seq,
        optimizer=optimizer,
        max_traced_blocks=max_traced_blocks,
        profile=profile,
        capacity=capacity,
        margin=margin,
        tokens=tokens,
        params=params,
        flops_per_token=flops_per_token,
        tiers=tiers,
        host_capacity=host_capacity_bytes,
    )
    with tempfile.TemporaryDirectory() as scratch:
        # the auto plan takes a profile by name or file (`BucketConfig.device`)
        profile_ref = device if isinstance(device, str) else str(Path(scratch) / "profile.json")
        if not isinstance(device, str):
            cost.save_profile(profile, profile_ref)
        work = [
            _Job(tp=degree, strategy=strategy, ac=policy, mp_policy=gathered, profile_ref=profile_ref, **common)
            for degree in tp
            for strategy in searched
            for policy in ac
            for gathered in policies
        ]
        jobs = jobs if isinstance(shape, ModelShape) else 1
        rows, traces = _search(work, jobs=jobs, on_progress=on_progress)
        ranked = rank_rows(rows)
        lossy = None
        if lossy_alternative is not None and set(gathers) == {None} and ranked and ranked[0].fits:
            lossy = _lossy(work, ranked[0], lossy_alternative, jobs=jobs, on_progress=on_progress)
    recosts = sum(not row.pruned for row in rows)
    advice = Advice(
        model=name,
        world_size=world_size,
        device=profile,
        capacity_bytes=capacity,
        margin=margin,
        rows=ranked,
        traces=traces,
        recosts=recosts,
        search_s=time.perf_counter() - started,
        lossy=lossy,
    )
    logger.info("advise: %d configurations, %d traced, %.1f s", len(rows), traces, advice.search_s)
    return advice


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Job:
    """One traced configuration (strategy x AC x TP) and what costing its pass variants needs."""

    shape: ModelShape | Callable[[], tuple[nn.Module, Any]]
    name: str
    world_size: int
    tp: int
    strategy: ShardingStrategy
    ac: str
    shard_size: int | None
    mp_policy: simplefsdp.MixedPrecisionPolicy
    batch: int | None
    seq: int | None
    optimizer: str
    max_traced_blocks: int
    profile: cost.DeviceProfile
    profile_ref: str  # the profile by name or file, for the auto plan's BucketConfig
    capacity: float
    margin: float
    tokens: int | None
    params: int | None  # the full-depth model's parameter count (named shapes)
    flops_per_token: float | None
    tiers: tuple[str, ...]  # offload tiers searched
    host_capacity: float | None  # host memory per rank (None: the profile's)

    def label(self) -> str:
        gather = "" if self.mp_policy.gather_dtype is None else f", {self.mp_policy.gather_dtype} gathers"
        return f"{self.strategy.value}, AC {self.ac}, TP {self.tp}{gather}"


def _persistent(job: _Job) -> Persistent:
    """The full-depth model's persistent memory per rank as `job` shards it (a task; no trace)."""
    mesh, tp_mesh = meshes(strategy=job.strategy, world_size=job.world_size, shard_size=job.shard_size, tp=job.tp)
    return full_depth_persistent(
        job.shape, mesh=mesh, tp_mesh=tp_mesh, strategy=job.strategy, mp_policy=job.mp_policy, optimizer=job.optimizer
    )


def _choices(job: _Job, tier: str = "none") -> list[Choice]:
    """The pass variants of `job`, one `Choice` each (re-costed on one trace), with offload `tier`."""
    return [
        Choice(
            strategy=job.strategy,
            ac=job.ac,
            tp=job.tp,
            plan=plan,
            prefetch_depth=depth,
            memory_budget=budget,
            offload=tier,
            gather_dtype=job.mp_policy.gather_dtype,
            gather_block=job.mp_policy.gather_block,
        )
        for plan, depth, budget in PASS_VARIANTS
    ]


def _device_persistent(job: _Job, persistent: Persistent, tier: str) -> int:
    """What `tier` leaves on the device of `persistent`'s parameter shards and optimizer state."""
    if tier == "all":
        return 0
    if tier == "optimizer":
        return int(persistent.params_bytes * copy_fraction(job.mp_policy))
    return persistent.params_bytes + persistent.optimizer_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Depth:
    """One traced depth of a job: each pass variant's numbers, in `PASS_VARIANTS` order, and (a
    factory's model, traced in full) the traced model's persistent memory."""

    costed: tuple[Costed, ...]
    persistent: Persistent | None


def _trace_and_cost(job: _Job, n_layers: int | None) -> _Depth:
    """Trace `job` at `n_layers` blocks with the pass off, then re-cost every pass variant on the
    graphs (a task: see [Note: trace once, re-cost many]); graphs stay here."""
    mesh, tp_mesh = meshes(strategy=job.strategy, world_size=job.world_size, shard_size=job.shard_size, tp=job.tp)
    settings = TraceSettings(
        mesh=mesh,
        tp_mesh=tp_mesh,
        strategy=job.strategy,
        ac=job.ac,
        mp_policy=job.mp_policy,
        passes=None,
        profile=job.profile,
        batch=job.batch,
        seq=job.seq,
        optimizer=job.optimizer,
    )
    report = trace_depth(job.shape, n_layers, settings=settings)
    costed = []
    for choice in _choices(job):
        config = choice.passes(device=job.profile_ref)
        graph_pass = None if config is None else make_pass(report.capture.model, config, mesh)
        costed.append(Costed.of(recost(report, graph_pass, device=job.profile, optimizer=job.optimizer)))
    persistent = None
    if not isinstance(job.shape, ModelShape):  # a factory's model: as traced (named shapes: `_persistent`)
        persistent = persistent_bytes(report.capture.model, optimizer=job.optimizer)
    return _Depth(costed=tuple(costed), persistent=persistent)


def _depths(job: _Job) -> tuple[list[int | None], list[int | None]]:
    """The depths a job may be traced at (three for a deep shape, see [Note: a steady state to
    extrapolate from]), and the ones its rows are extrapolated from (the last two)."""
    depths_all = depths(job.shape, max_traced_blocks=job.max_traced_blocks, count=3)
    return depths_all, depths_all[1:] if len(depths_all) == 3 else depths_all


def _lossy(
    work: Sequence[_Job], winner: Row, gather: str, *, jobs: int, on_progress: Callable[[str], None] | None
) -> Row:
    """The `winner`'s configuration with `gather` quantized gathers, traced at the depths the search
    traced it ([Note: lossy gathers, on request]); its steadiness is not checked (None) for a deep shape."""
    choice = winner.choice
    found = next(j for j in work if (j.strategy, j.tp, j.ac) == (choice.strategy, choice.tp, choice.ac))
    job = dataclasses.replace(
        found, mp_policy=dataclasses.replace(found.mp_policy, gather_dtype=gather), tiers=(choice.offload,)
    )
    _, main = _depths(job)
    with Workers(jobs=min(jobs, len(main) + 1), world_size=job.world_size, on_progress=on_progress) as workers:
        held = {}
        if isinstance(job.shape, ModelShape):
            held[(job.strategy, job.tp)] = workers.map(_persistent, [(job,)], label=lambda j: f"sharded {j.label()}")[0]
        traced = workers.map(
            _trace_and_cost, [(job, n) for n in main], label=lambda j, n: f"traced {j.label()} (the lossy alternative)"
        )
    wanted = dataclasses.replace(choice, gather_dtype=gather, gather_block=job.mp_policy.gather_block)
    rows = _rows(job, traced, main, held, steady=None if len(main) == 2 else True)
    return next(row for row in rows if row.choice == wanted)


def _search(work: list[_Job], *, jobs: int, on_progress: Callable[[str], None] | None) -> tuple[list[Row], int]:
    """The rows of every job in `work` and how many jobs were traced, in three rounds of tasks over
    `Workers` (see [Note: the search's rounds])."""
    first = work[0]
    depths_all, main = _depths(first)
    with Workers(jobs=jobs, world_size=first.world_size, on_progress=on_progress) as workers:
        held: dict[tuple, Persistent] = {}  # by (strategy, TP): the gather dtype changes no shard
        if isinstance(first.shape, ModelShape):
            keys = list(dict.fromkeys((job.strategy, job.tp) for job in work))
            one_job = {(job.strategy, job.tp): job for job in reversed(work)}
            found = workers.map(_persistent, [(one_job[k],) for k in keys], label=lambda j: f"sharded {j.label()}")
            held = dict(zip(keys, found, strict=True))
        pruned: dict[int, list[Row]] = {}
        for i, job in enumerate(work):
            persistent = held.get((job.strategy, job.tp))
            if persistent is None:
                continue
            lightest = max(job.tiers, key=TIERS.index)
            bound = _lower_bound(
                _device_persistent(job, persistent, lightest),
                params=job.params,
                strategy=job.strategy,
                ac=job.ac,
                tp=job.tp,
                itemsize=(job.mp_policy.param_dtype or torch.float32).itemsize,
            )
            if bound > job.capacity:
                pruned[i] = [_pruned(c, bound, job.profile, job.capacity, job.margin) for c in _choices(job, lightest)]
        live = [i for i in range(len(work)) if i not in pruned]
        if on_progress is not None:
            at = "in full" if len(main) == 1 else f"at {' and '.join(map(str, main))} blocks"
            on_progress(
                f"{len(work)} strategy x AC x TP combinations: {len(pruned)} pruned by the memory bound, "
                f"{len(live)} to trace {at} with {jobs} worker(s)"
            )

        def traced_label(job: _Job, n: int | None) -> str:
            return f"traced {job.label()}" + ("" if n is None else f" at {n} blocks")

        calls = [(work[i], n) for i in live for n in main]
        found = iter(workers.map(_trace_and_cost, calls, label=traced_label))
        by_job = {i: [next(found) for _ in main] for i in live}
        rows = {i: _rows(work[i], by_job[i], main, held, steady=None if len(main) == 2 else True) for i in live}
        # [Note: checking only what can win]: best first, CHECK_BATCH at a time
        unchecked = sorted(
            (i for i in live if len(main) == 2 and any(row.verdict.fits for row in rows[i])),
            key=lambda i: _potential(rows[i]),
        )
        checked: list[int] = []
        while unchecked and not _decided(rows, checked, unchecked):
            batch, unchecked = unchecked[:CHECK_BATCH], unchecked[CHECK_BATCH:]
            extra = workers.map(_trace_and_cost, [(work[i], depths_all[0]) for i in batch], label=traced_label)
            for i, earlier in zip(batch, extra, strict=True):
                rows[i] = _rows(work[i], [earlier, *by_job[i]], depths_all, held, steady=None)
            checked += batch
        if unchecked and on_progress is not None:
            on_progress(f"{len(unchecked)} configuration(s) left unchecked: none of their rows can beat the winner")
    ordered = [row for i in range(len(work)) for row in (pruned.get(i) or rows[i])]
    return ordered, len(live)


def _speed_key(row: Row) -> tuple:
    """How [Note: ranking] orders two rows that fit: most tokens/s first (a factory model: shortest step)."""
    return (-row.result.tokens_per_s if row.result.tokens else row.result.step_s, row.choice.order())


def _potential(rows: Sequence[Row]) -> tuple:
    """The rank its configuration's best row would take if checked steady: the best speed key among
    the rows that fit by the extrapolation (an extrapolation does not change when checked)."""
    return min(_speed_key(row) for row in rows if row.verdict.fits)


def _decided(rows: dict[int, list[Row]], checked: Sequence[int], unchecked: Sequence[int]) -> bool:
    """Whether a checked row that fits (steady) ranks before every row an unchecked configuration
    could offer: then no check can change the winner."""
    best = [_speed_key(row) for i in checked for row in rows[i] if row.fits]
    return bool(best) and all(min(best) <= _potential(rows[i]) for i in unchecked)


CHECK_BATCH = 2  # configurations checked at 4 blocks per round of checks ([Note: checking only what can win])
UNSTEADY = 0.1  # relative disagreement between the two extrapolations that marks a row unsteady


def _steady(costed: Sequence[Costed], blocks: Sequence[int], n_layers: int) -> bool:
    """Whether extrapolating from the first two of three traced depths agrees with the last two."""
    early = estimate(costed[:2], blocks=blocks[:2], n_layers=n_layers)
    late = estimate(costed[1:], blocks=blocks[1:], n_layers=n_layers)
    pairs = ((early.step_s, late.step_s), (early.transient_bytes, late.transient_bytes))
    return all(abs(a - b) <= UNSTEADY * max(abs(b), 1e-30) for a, b in pairs)


def _rows(
    job: _Job, traced: list[_Depth], blocks: Sequence[int | None], held: dict[tuple, Persistent], *, steady: bool | None
) -> list[Row]:
    """`job`'s rows from its traced depths (`blocks`); with three depths each row's steadiness is
    checked, else it is `steady` (None: not checked, see [Note: the search's rounds])."""
    n_layers = job.shape.n_layers if isinstance(job.shape, ModelShape) else None
    persistent = held.get((job.strategy, job.tp)) or traced[-1].persistent
    extrapolated = tuple(blocks[-2:]) if len(blocks) > 1 else (n_layers or 0,)
    rows = []
    for v, traced_choice in enumerate(_choices(job)):
        costed = [depth.costed[v] for depth in traced]
        state = _steady(costed, blocks, n_layers) if len(blocks) == 3 else steady
        traced_rows = Traced(
            costed=tuple(costed[-2:]), blocks=extrapolated, n_layers=n_layers, persistent=persistent, report=None
        )
        traced_result = result_of(
            traced_rows,
            model=job.name,
            world_size=job.world_size,
            device=job.profile,
            trace_s=0.0,
            tp=traced_choice.tp,
            ac=traced_choice.ac,
            tokens=job.tokens,
        )
        for tier in job.tiers:
            choice = dataclasses.replace(traced_choice, offload=tier)
            result = with_offload(
                traced_result,
                tier=tier,
                copy_fraction=copy_fraction(job.mp_policy),
                reshards=reshards(job.strategy, job.ac),
            )
            mfu = None
            if job.flops_per_token is not None and result.tokens_per_s:
                mfu = result.tokens_per_s * job.flops_per_token / (job.world_size * job.profile.flops_per_s)
            verdict = memory_verdict(
                result, margin=job.margin, capacity_bytes=job.capacity, host_capacity_bytes=job.host_capacity
            )
            rows.append(Row(choice=choice, verdict=verdict, result=result, mfu=mfu, steady=state))
    return rows


def rank_rows(rows: Sequence[Row]) -> tuple[Row, ...]:
    """`rows` best first, per [Note: ranking] (whatever order they come in)."""

    def key(row: Row) -> tuple:
        if row.fits:
            return (0, *_speed_key(row))
        if row.steady is None and row.verdict.fits:  # fits, not checked: it could not have won
            return (1, *_speed_key(row))
        return (2, row.verdict.peak_bytes, row.choice.order())

    return tuple(sorted(rows, key=key))


def _pruned(choice: Choice, bound: int, profile: cost.DeviceProfile, capacity: float, margin: float) -> Row:
    verdict = MemoryVerdict(
        device=profile.name,
        capacity_bytes=capacity,
        peak_bytes=bound,
        margin=margin,
        parts={},
        hint="its parameter shards, optimizer state and the weights it keeps gathered alone exceed the memory",
    )
    return Row(choice=choice, verdict=verdict, bound_bytes=bound)
