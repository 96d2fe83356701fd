"""The advisor: which configuration to run -- the fastest predicted one that fits with a margin.

    advice = advise("llama3-70b", world_size=64, device="h100", tp=(1, 8))
    advice.winner.choice, advice.winner.result.step_s, advice.rows   # ranked, best first

It searches sharding strategy (FULL_SHARD re-gathers in backward, SHARD_GRAD_OP keeps the gathered
weights; with a `shard_size`, the two HYBRID strategies too) x activation checkpointing (none,
selective, full) x tensor-parallel degree (those asked for) x what simplefsdp's pass does (no
passes; one bucket per block with prefetch depth 0, 1 or 2; the cost model's `auto` plan, which
picks buckets and depth itself), costs each with the dry run's models (`schedule.py`, the
liveness walk, the device profile) and ranks them.

[Note: trace once, re-cost many]
Only the first three axes change the graphs torch traces (reshard or keep, recompute or save,
which collectives tensor parallelism adds), so each of their combinations is traced once (twice
for a deep shape, see [Note: tracing a few blocks and extrapolating] in `dryrun.py`) with the pass
off, and the pre-pass graphs are kept. Every pass variant is then the real `FsdpPass` -- built for
the traced model and mesh exactly as `wrap()` builds it (`simplefsdp.wrap.make_pass`) -- run on a
copy of those graphs: the graphs the compiler would have produced, without compiling again. (The
test suite checks that re-costing the default pass gives the same step time and peak as a trace
with the pass on.)

[Note: pruning by a lower bound]
Some configurations cannot fit whatever the trace says: each rank holds at least its parameter
shards and optimizer state, and under SHARD_GRAD_OP / HYBRID_SHARD_ZERO2 also every gathered
parameter from its forward to its backward (at least the model's parameter count over the
tensor-parallel degree, in the gather dtype). When that bound alone exceeds the device's memory,
the configuration is listed as not fitting, with the bound, and not traced: for Llama-3-405B at
1024 ranks this skips the ZeRO-2 traces, which keeps the search under two minutes on two cores.

[Note: ranking]
Rows that fit with the margin come first, most tokens per second over the world first (not the
shortest step: a step with tensor parallelism of degree t trains t times fewer sequences over the
same GPUs; a factory model's tokens are unknown and its step time decides, it has no TP); then the
rest, smallest peak first. Ties keep the search's fixed order (strategy, AC, TP, plan, prefetch as listed
above), so the ranking is a pure function of the traced graphs, the profile, the capacity and the
margin: the same answer every time.

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
from simplefsdp.inspect.dryrun import (
    AC_POLICIES,
    DryRunResult,
    Traced,
    fake_world,
    full_depth_persistent,
    meshes,
    result_of,
    trace,
)
from simplefsdp.inspect.memory import check_optimizer
from simplefsdp.inspect.record import StepGraphs
from simplefsdp.inspect.report import Report, analyse, resolve_profile
from simplefsdp.inspect.shapes import ModelShape, model_shape
from simplefsdp.inspect.verdict import MemoryVerdict, memory_verdict
from simplefsdp.passes import cost
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.reorder import ReorderConfig
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.wrap import make_pass

__all__ = ["PASS_VARIANTS", "Advice", "Choice", "Row", "advise", "rank", "recost"]

logger = logging.getLogger(__name__)

# (plan, prefetch depth) re-costed per trace; see the module docstring
PASS_VARIANTS: tuple[tuple[str, int | None], ...] = (
    ("none", None),
    ("blocks", 0),
    ("blocks", 1),
    ("blocks", 2),
    ("auto", None),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """One configuration the advisor costs. `prefetch_depth` is None for the auto plan (it picks)
    and for no passes."""

    strategy: ShardingStrategy
    ac: str
    tp: int
    plan: str  # "none" (passes off), "blocks", "auto"
    prefetch_depth: int | None

    def order(self) -> tuple[int, int, int, int]:
        """Position in the search's fixed order (TP, strategy, AC, pass variant): the ranking's tie-break."""
        strategies = list(ShardingStrategy)
        return (
            self.tp,
            strategies.index(self.strategy),
            AC_POLICIES.index(self.ac),
            PASS_VARIANTS.index((self.plan, self.prefetch_depth)),
        )

    def label(self) -> str:
        plan = self.plan if self.prefetch_depth is None else f"{self.plan}, prefetch {self.prefetch_depth}"
        return f"{self.strategy.value}, AC {self.ac}, TP {self.tp}, {plan}"

    def passes(self, *, device: str) -> PassConfig | None:
        """The `PassConfig` this choice wraps with (`device`: the profile name or file the auto plan costs with)."""
        if self.plan == "none":
            return None
        if self.plan == "auto":
            return PassConfig(bucket=BucketConfig(plan="auto", device=device))
        return PassConfig(bucket=BucketConfig(plan="blocks"), reorder=ReorderConfig(prefetch_depth=self.prefetch_depth))

    def train_flags(self, *, param_dtype: str, reduce_dtype: str, batch: int, seq: int, profile: str) -> str:
        """The `simplefsdp train` flags that run this configuration."""
        flags = [
            f"--strategy {self.strategy.value}",
            f"--tp {self.tp}",
            f"--activation-checkpoint {self.ac}",
            f"--bucket-plan {self.plan}",
            f"--param-dtype {param_dtype}",
            f"--reduce-dtype {reduce_dtype}",
            f"--batch-per-rank {batch}",
            f"--seq-len {seq}",
        ]
        if self.prefetch_depth is not None:
            flags.append(f"--prefetch-depth {self.prefetch_depth}")
        if self.plan == "auto":
            flags.append(f"--profile {profile}")
        return " ".join(flags)

    def wrap_call(self, *, param_dtype: str, reduce_dtype: str, profile: str, shard_size: int | None) -> str:
        """Python that wraps a model as this configuration does (a CUDA job under torchrun)."""
        lines = ["import torch, simplefsdp", "from torch.distributed.device_mesh import init_device_mesh"]
        world = "torch.distributed.get_world_size()"
        if self.tp > 1:
            lines += [
                "from torch.distributed.tensor.parallel import parallelize_module",
                "from simplefsdp.models import tensor_parallel_plan",
                f'mesh = init_device_mesh("cuda", ({world} // {self.tp}, {self.tp}), mesh_dim_names=("dp", "tp"))',
                'parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))',
                'dp_mesh = mesh["dp"]',
            ]
        elif self.strategy.is_hybrid:
            lines.append(
                f'dp_mesh = init_device_mesh("cuda", ({world} // {shard_size}, {shard_size}), '
                'mesh_dim_names=("replicate", "shard"))'
            )
        else:
            lines.append(f'dp_mesh = init_device_mesh("cuda", ({world},))')
        if self.ac != "none":
            lines.append(f'simplefsdp.checkpoint_blocks(model, policy="{self.ac}")')
        if self.plan == "none":
            passes = "None"
        elif self.plan == "auto":
            passes = f'simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="auto", device="{profile}"))'
        else:
            passes = f"simplefsdp.PassConfig(reorder=simplefsdp.ReorderConfig(prefetch_depth={self.prefetch_depth}))"
        mp = (
            f"simplefsdp.MixedPrecisionPolicy(param_dtype=torch.{_DTYPE_NAMES[param_dtype]}, "
            f"reduce_dtype=torch.{_DTYPE_NAMES[reduce_dtype]})"
        )
        lines += [
            "model = simplefsdp.wrap(",
            f'    model, dp_mesh, strategy="{self.strategy.value}",',
            f"    mp_policy={mp},",
            f"    passes={passes},",
            ")",
            "model = torch.compile(model)",
        ]
        return "\n".join(lines)


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One costed (or pruned) configuration. `result` is None when pruned by the lower bound
    (`bound_bytes`, see [Note: pruning by a lower bound])."""

    choice: Choice
    verdict: MemoryVerdict
    result: DryRunResult | None = None
    bound_bytes: int | None = None
    mfu: float | None = None

    @property
    def fits(self) -> bool:
        return bool(self.verdict.fits)

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
    traces: int  # configurations traced (each one or two compiles)
    recosts: int  # pass variants re-costed on traced graphs
    search_s: float

    @property
    def winner(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None


def recost(
    report: Report, graph_pass: FsdpPass | None, *, device: cost.DeviceProfile, optimizer: str = "adamw"
) -> Report:
    """`report`'s step as `graph_pass` would have compiled it: the pass run on copies of the recorded
    pre-pass graphs (None: no pass), analysed on `device`. See [Note: trace once, re-cost many]."""
    graphs = report.capture.graphs
    forward, backward = copy.deepcopy(graphs.forward_pre), copy.deepcopy(graphs.backward_pre)
    if graph_pass is not None:
        graph_pass(forward)
        graph_pass(backward)
    post = StepGraphs(pre=[graphs.forward_pre, graphs.backward_pre], post=[forward, backward])
    return analyse(dataclasses.replace(report.capture, graphs=post), device=device, optimizer=optimizer)


def _model_flops_per_token(shape: ModelShape, *, seq: int) -> float:
    params = sum(p.numel() for p in shape.build().parameters())  # meta: free
    return 6.0 * params + 12.0 * shape.args.n_layers * shape.args.dim * seq


def _keeps_gathered(strategy: ShardingStrategy) -> bool:
    return strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)


def _lower_bound(
    shape: ModelShape | Callable, persistent_total: int, *, strategy: ShardingStrategy, tp: int, itemsize: int
) -> int:
    """Bytes per rank no run of this configuration can go below (see [Note: pruning by a lower bound])."""
    if not (_keeps_gathered(strategy) and isinstance(shape, ModelShape)):
        return persistent_total
    params = sum(p.numel() for p in shape.build().parameters())
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
    shard_size: int | None = None,
    mp_policy: simplefsdp.MixedPrecisionPolicy | None = None,
    batch: int | None = None,
    seq: int | None = None,
    optimizer: str = "adamw",
    margin: float = 0.1,
    capacity_bytes: float | None = None,
    max_traced_blocks: int = 8,
    on_progress: Callable[[str], None] | None = None,
) -> Advice:
    """Search the configurations of the module docstring for `model` at `world_size` ranks on
    `device` and rank them. `capacity_bytes` overrides the profile's memory; `margin` is the fits
    verdict's safety margin; `on_progress(label)` is called before each trace."""
    profile = resolve_profile(device)
    check_optimizer(optimizer)
    capacity = capacity_bytes if capacity_bytes is not None else profile.capacity_bytes
    _check(world_size, tp, ac, capacity, profile.name)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if tuple(tp) != (1,) and not isinstance(model, (str, ModelShape)):
        raise ValueError("tp > 1 needs a named shape (a factory's model has no tensor-parallel plan here)")
    if mp_policy is None:
        mp_policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shape = model_shape(model) if isinstance(model, str) else model
    name = shape.name if isinstance(shape, ModelShape) else getattr(model, "__name__", type(model).__name__)
    tokens = shape.example_input(batch=batch, seq=seq).numel() if isinstance(shape, ModelShape) else None
    flops_per_token = _model_flops_per_token(shape, seq=seq or shape.seq) if isinstance(shape, ModelShape) else None
    itemsize = (mp_policy.param_dtype or torch.float32).itemsize
    started = time.perf_counter()
    rows: list[Row] = []
    traces = recosts = 0
    with tempfile.TemporaryDirectory() as scratch, fake_world(world_size):
        # the auto plan takes a profile by name or file (`BucketConfig.device`)
        profile_ref = device if isinstance(device, str) else str(Path(scratch) / "profile.json")
        if not isinstance(device, str):
            cost.save_profile(profile, profile_ref)
        for degree in tp:
            for strategy in _strategies(shard_size):
                mesh, tp_mesh = meshes(strategy=strategy, world_size=world_size, shard_size=shard_size, tp=degree)
                persistent = None
                if isinstance(shape, ModelShape):
                    persistent = full_depth_persistent(
                        shape, mesh=mesh, tp_mesh=tp_mesh, strategy=strategy, mp_policy=mp_policy, optimizer=optimizer
                    )
                for policy in ac:
                    choices = [
                        Choice(strategy=strategy, ac=policy, tp=degree, plan=plan, prefetch_depth=depth)
                        for plan, depth in PASS_VARIANTS
                    ]
                    if persistent is not None:
                        held = persistent.params_bytes + persistent.optimizer_bytes
                        bound = _lower_bound(shape, held, strategy=strategy, tp=degree, itemsize=itemsize)
                        if bound > capacity:
                            rows += [_pruned(c, bound, profile, capacity, margin) for c in choices]
                            continue
                    if on_progress is not None:
                        on_progress(f"tracing {strategy.value}, AC {policy}, TP {degree}")
                    traced = trace(
                        shape,
                        mesh=mesh,
                        tp_mesh=tp_mesh,
                        strategy=strategy,
                        ac=policy,
                        mp_policy=mp_policy,
                        passes=None,
                        profile=profile,
                        batch=batch,
                        seq=seq,
                        optimizer=optimizer,
                        max_traced_blocks=max_traced_blocks,
                    )
                    traces += 1
                    for choice in choices:
                        result = _cost(choice, traced, mesh, profile, profile_ref, optimizer, name, world_size, tokens)
                        recosts += 1
                        mfu = None
                        if flops_per_token is not None and result.tokens_per_s:
                            mfu = result.tokens_per_s * flops_per_token / (world_size * profile.flops_per_s)
                        verdict = memory_verdict(result, margin=margin, capacity_bytes=capacity)
                        rows.append(Row(choice=choice, verdict=verdict, result=result, mfu=mfu))
    advice = Advice(
        model=name,
        world_size=world_size,
        device=profile,
        capacity_bytes=capacity,
        margin=margin,
        rows=rank(rows),
        traces=traces,
        recosts=recosts,
        search_s=time.perf_counter() - started,
    )
    logger.info("advise: %d configurations, %d traced, %.1f s", len(rows), traces, advice.search_s)
    return advice


def rank(rows: Sequence[Row]) -> tuple[Row, ...]:
    """`rows` best first, per [Note: ranking] (whatever order they come in)."""

    def key(row: Row) -> tuple:
        if row.fits:
            return (0, -row.result.tokens_per_s if row.result.tokens else row.result.step_s, row.choice.order())
        return (1, row.verdict.peak_bytes, row.choice.order())

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


def _cost(
    choice: Choice,
    traced: Traced,
    mesh,
    profile: cost.DeviceProfile,
    profile_ref: str,
    optimizer: str,
    name: str,
    world_size: int,
    tokens: int | None,
) -> DryRunResult:
    """The dry-run result of `choice` on `traced`'s graphs, re-costed (no compile)."""
    config = choice.passes(device=profile_ref)
    reports = []
    for report in traced.reports:
        graph_pass = None if config is None else make_pass(report.capture.model, config, mesh)
        reports.append(recost(report, graph_pass, device=profile, optimizer=optimizer))
    return result_of(
        traced,
        tuple(reports),
        model=name,
        world_size=world_size,
        device=profile,
        trace_s=0.0,
        tp=choice.tp,
        ac=choice.ac,
        tokens=tokens,
    )
