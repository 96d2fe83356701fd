"""Dry run: predict a training step at any world size, for a device profile, with no GPU and no memory.

    result = dry_run("llama3-70b", world_size=1024, device="h100")
    result.step_s, result.exposed_pct, result.peak_bytes

The process joins torch's "fake" process group as rank 0 of `world_size` ranks (collectives trace
but move nothing), builds the model on the meta device, wraps it, traces one training step with
simplefsdp's passes (`capture.py`), and costs it with `passes/cost.py` -- the model the `auto`
bucket plan uses -- on the two-stream schedule of `schedule.py` and the liveness walk of
`memory.py`.

[Note: tracing a few blocks and extrapolating]
Tracing cost grows with the number of blocks, not their size (fake tensors), but a 126-block
model still takes minutes. A named shape with more than `max_traced_blocks` blocks is traced
twice, with k and k + 1 blocks (k = 4: the first and last blocks, whose collectives neighbour
the non-block parameters, and two in steady state -- with k = 3 the backward of an
activation-checkpointed Llama-3-70B shape was not yet steady: its peak's communication buffers
grew by 1.6 GiB from 3 to 4 blocks and not at all from 4 to 5; scaled by 76 blocks, that jump
predicted a 226 GiB peak instead of 46), and every per-step quantity -- step time,
exposed communication, transient memory -- is extrapolated linearly to the full depth:
`v(L) = v(k + 1) + (L - k - 1) * (v(k + 1) - v(k))`; the transient memory per graph (forward,
backward), then the larger of the two at full depth -- which graph peaks can change with depth
(with activation checkpointing the two are close), and a jump between them must not be scaled
by the depth. This is exact when each added block adds the same work, which holds for a stack of
identical blocks with prefetch depth 1: tested against a full trace of 8 blocks, step time and
exposed time agree to 1e-6; the memory peak, a maximum over time rather than a sum, to 0.6%.
Persistent memory (parameters, gradients, optimizer state) is computed from the full-depth model,
not extrapolated. Results say which blocks were traced (`traced_blocks`).

Tensor parallelism (`tp > 1`, named shapes only): the world becomes a `(world / tp, tp)` mesh
named ("dp", "tp"); the model is parallelized on "tp" with `simplefsdp.models.tensor_parallel_plan`
(sequence parallel) and wrapped on "dp". Activation checkpointing (`ac="full" | "selective"`)
checkpoints every repeated block with `simplefsdp.checkpoint_blocks` before wrapping.

Device profiles: `passes/cost.py` holds the numbers and their sources; any `DeviceProfile` (e.g.
one measured on the machine, as `bench/inspect_validate.py` does) can be passed instead of a name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import simplefsdp
from simplefsdp._compat import init_fake_process_group
from simplefsdp.inspect.memory import GraphPeak, MemoryEstimate, Persistent, check_optimizer, persistent_bytes
from simplefsdp.inspect.offload_cost import check_tier, copy_fraction, reshards, with_offload
from simplefsdp.inspect.report import Report, inspect_model, resolve_profile
from simplefsdp.inspect.shapes import ModelShape, check_batch_and_seq, model_shape
from simplefsdp.passes import cost
from simplefsdp.settings import AC_POLICIES
from simplefsdp.strategy import ShardingStrategy

__all__ = ["AC_POLICIES", "DryRunResult", "dry_run", "fake_world", "make_mesh"]

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1 << 17
_TRACED = 4  # see [Note: tracing a few blocks and extrapolating]


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake world of `world_size` ranks, for the duration of the block."""
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an integer from 1 to {MAX_WORLD_SIZE}, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError(
            f"a process group is already initialized (backend {dist.get_backend()!r}, world "
            f"{dist.get_world_size()}); a dry run makes its own fake world: run it in a fresh process"
        )
    init_fake_process_group(rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_shard_size(*, strategy: ShardingStrategy | str, world_size: int, shard_size: int | None) -> None:
    """`ValueError` naming `shard_size` unless it suits `strategy` at `world_size`: a divisor of the
    world for the HYBRID strategies, None (or the world) for the others."""
    strategy = ShardingStrategy.parse(strategy)
    if not strategy.is_hybrid:
        if shard_size not in (None, world_size):
            raise ValueError(f"{strategy.value} shards over the whole world; shard_size={shard_size} is for HYBRID_*")
    elif shard_size is None or shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"{strategy.value} needs a 2-D mesh (replicate, shard): shard_size must divide the world size "
            f"{world_size}, got {shard_size!r}"
        )


def make_mesh(*, strategy: ShardingStrategy | str, world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """The data-parallel mesh of `strategy` over `world_size` ranks: 1-D, or `(world / shard_size,
    shard_size)` for the HYBRID strategies (`shard_size` ranks shard, e.g. the GPUs of a node)."""
    check_shard_size(strategy=strategy, world_size=world_size, shard_size=shard_size)
    if not ShardingStrategy.parse(strategy).is_hybrid:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def _tp_mesh(*, strategy: ShardingStrategy, world_size: int, tp: int) -> DeviceMesh:
    """The ("dp", "tp") mesh of `world_size` ranks, `tp` ranks per tensor-parallel group."""
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp must be a positive integer dividing the world size {world_size}, got {tp!r}")
    if strategy.is_hybrid:
        raise ValueError(
            f"the dry run composes tensor parallelism with FULL_SHARD / SHARD_GRAD_OP, not {strategy.value}"
        )
    return init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def _prepare(module: nn.Module, *, ac: str, tp_mesh: DeviceMesh | None) -> None:
    """Tensor-parallelize and checkpoint `module` as the dry run's settings say, before wrapping."""
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        from simplefsdp.models import tensor_parallel_plan

        parallelize_module(module, tp_mesh, tensor_parallel_plan(module))
    if ac != "none":
        simplefsdp.checkpoint_blocks(module, policy=ac)


def _phase(costed: Costed, phase: str) -> GraphPeak:
    return costed.memory.forward if phase == "forward" else costed.memory.backward


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costed:
    """What a result needs of one traced depth: its step's times and memory (no graphs: small and
    picklable, so worker processes can send it back)."""

    step_s: float
    exposed_s: float
    memory: MemoryEstimate

    @classmethod
    def of(cls, report: Report) -> Costed:
        return cls(step_s=report.schedule.step_s, exposed_s=report.schedule.exposed_s, memory=report.memory)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Traced:
    """One configuration's costed step: one depth (traced in full, `blocks == (n_layers,)`) or one
    per depth (`blocks == (k, k + 1, ...)`, extrapolated to `n_layers`), the full-depth model's
    persistent memory, and the last depth's report (None where the graphs were not kept)."""

    costed: tuple[Costed, ...]
    blocks: tuple[int, ...]
    n_layers: int | None  # blocks of the full model (None for a model given as a factory)
    persistent: Persistent
    report: Report | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """A step's predicted numbers at full depth: see [Note: tracing a few blocks and extrapolating]."""

    step_s: float
    exposed_s: float
    transient_bytes: int  # the larger graph's transient peak
    parts: dict[str, int]  # that peak by kind (liveness.ACTIVATIONS, ...)


def _linear(small: float, large: float, large_at: int, target: int) -> float:
    return large + (target - large_at) * (large - small)


def estimate(costed: Sequence[Costed], *, blocks: Sequence[int], n_layers: int | None) -> Estimate:
    """Step time, exposed time and transient peak of `costed` (one: as traced; more, of `blocks`
    `(k, k + 1, ...)`: extrapolated to `n_layers` blocks from the last two)."""
    if len(costed) == 1:
        (only,) = costed
        phase = max(("backward", "forward"), key=lambda g: _phase(only, g).peak_bytes)
        return Estimate(
            step_s=only.step_s,
            exposed_s=only.exposed_s,
            transient_bytes=only.memory.transient_bytes,
            parts=dict(_phase(only, phase).at_peak),
        )
    small, large = costed[-2:]

    def extrapolate(value: Callable[[Costed], float]) -> float:
        return _linear(value(small), value(large), blocks[-1], n_layers)

    # each graph's peak on its own, then the larger: which graph peaks can change with depth
    phase = max(("forward", "backward"), key=lambda g: extrapolate(lambda c: _phase(c, g).peak_bytes))
    kinds = sorted(set(_phase(small, phase).at_peak) | set(_phase(large, phase).at_peak))
    return Estimate(
        step_s=extrapolate(lambda c: c.step_s),
        exposed_s=extrapolate(lambda c: c.exposed_s),
        transient_bytes=int(extrapolate(lambda c: _phase(c, phase).peak_bytes)),
        parts={k: int(extrapolate(lambda c, k=k: _phase(c, phase).at_peak.get(k, 0))) for k in kinds},
    )


def depths(shape: ModelShape | Callable[[], tuple[nn.Module, Any]], *, max_traced_blocks: int, count: int) -> tuple:
    """The block counts to trace: `(None,)` (a factory's model, in full), `(n_layers,)` (a named
    shape no deeper than `max_traced_blocks`), else `count` consecutive ones from k (see the note)."""
    full_layers = shape.n_layers if isinstance(shape, ModelShape) else None
    if full_layers is None or full_layers <= max_traced_blocks:
        return (full_layers,)
    return tuple(range(_TRACED, _TRACED + count))


def built_by(factory: Callable[[], tuple[nn.Module, Any]]) -> tuple[nn.Module, Any]:
    """`factory()`, checked to be `(module, example input)`: a ValueError naming the factory otherwise."""
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        name = getattr(factory, "__qualname__", repr(factory))
        raise ValueError(
            f"model factory {name} must return (nn.Module, example input), got {type(built).__name__} {built!r:.80}"
        )
    return built


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceSettings:
    """How one configuration is traced: on which meshes, wrapped how, costed on which profile."""

    mesh: DeviceMesh
    tp_mesh: DeviceMesh | None
    strategy: ShardingStrategy
    ac: str
    mp_policy: simplefsdp.MixedPrecisionPolicy
    passes: simplefsdp.PassConfig | None
    profile: cost.DeviceProfile
    batch: int | None = None
    seq: int | None = None
    optimizer: str = "adamw"
    code: bool = False


def trace_depth(
    shape: ModelShape | Callable[[], tuple[nn.Module, Any]], n_layers: int | None, *, settings: TraceSettings
) -> Report:
    """Trace and analyse one step of `shape` with `n_layers` blocks (a factory: its model as built)
    as `settings` say (inside `fake_world`)."""
    torch.compiler.reset()  # a fresh Dynamo cache: each trace is a new model of the same class
    if isinstance(shape, ModelShape):
        module, example = shape.build(n_layers=n_layers), shape.example_input(batch=settings.batch, seq=settings.seq)
        if settings.ac != "none":  # the built-in model's blocks: torch's checkpoint warning is noise for them
            from simplefsdp.train.quiet import drop_benign_torch_warnings  # here: train imports inspect

            drop_benign_torch_warnings()
    else:
        module, example = built_by(shape)
    _prepare(module, ac=settings.ac, tp_mesh=settings.tp_mesh)
    simplefsdp.wrap(  # the cost model prices each op of the traced graphs: no region hides a block's ops
        module,
        settings.mesh,
        strategy=settings.strategy,
        mp_policy=settings.mp_policy,
        passes=settings.passes,
        compile_regions=False,
    )
    return inspect_model(module, example, device=settings.profile, optimizer=settings.optimizer, code=settings.code)


def trace(
    shape: ModelShape | Callable[[], tuple[nn.Module, Any]], *, settings: TraceSettings, max_traced_blocks: int = 8
) -> Traced:
    """Trace one configuration (inside `fake_world`): in full, or at two consecutive block counts
    from k when a named shape is deeper than `max_traced_blocks`."""
    blocks = depths(shape, max_traced_blocks=max_traced_blocks, count=2)
    reports = [trace_depth(shape, n, settings=settings) for n in blocks]
    if len(blocks) == 1:
        persistent = persistent_bytes(reports[0].capture.model, optimizer=settings.optimizer)
    else:
        persistent = full_depth_persistent(
            shape,
            mesh=settings.mesh,
            tp_mesh=settings.tp_mesh,
            strategy=settings.strategy,
            mp_policy=settings.mp_policy,
            optimizer=settings.optimizer,
        )
    return Traced(
        costed=tuple(map(Costed.of, reports)),
        blocks=tuple(n or 0 for n in blocks),
        n_layers=shape.n_layers if isinstance(shape, ModelShape) else None,
        persistent=persistent,
        report=reports[-1],
    )


def full_depth_persistent(
    shape: ModelShape,
    *,
    mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    strategy: ShardingStrategy,
    mp_policy: simplefsdp.MixedPrecisionPolicy,
    optimizer: str,
) -> Persistent:
    """Per-rank persistent memory of the full-depth `shape`, sharded as a trace shards it (on meta: free)."""
    full = shape.build()
    _prepare(full, ac="none", tp_mesh=tp_mesh)
    simplefsdp.wrap(full, mesh, strategy=strategy, mp_policy=mp_policy, passes=None, compile_regions=False)
    return persistent_bytes(full, optimizer=optimizer)


def meshes(
    *, strategy: ShardingStrategy, world_size: int, shard_size: int | None, tp: int
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the data-parallel mesh, the tensor-parallel mesh or None) of a configuration, inside `fake_world`."""
    if tp == 1:
        return make_mesh(strategy=strategy, world_size=world_size, shard_size=shard_size), None
    world_mesh = _tp_mesh(strategy=strategy, world_size=world_size, tp=tp)
    return world_mesh["dp"], world_mesh["tp"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRunResult:
    model: str
    world_size: int
    device: cost.DeviceProfile
    n_layers: int | None  # blocks of the full model (None for a model given as a factory)
    traced_blocks: tuple[int, ...]  # block counts traced; more than one: extrapolated
    step_s: float
    exposed_s: float
    peak_bytes: int
    persistent: Persistent  # parameters, gradients, optimizer state of the full-depth model, per rank
    transient_parts: dict[str, int]  # the transient peak by kind (liveness.ACTIVATIONS, ...), full depth
    report: Report | None  # the last trace (its tables and pictures show the traced blocks only);
    # None in the advisor's rows, which keep no graphs
    trace_s: float
    tp: int = 1
    ac: str = "none"
    tokens: int | None = None  # tokens per data-parallel rank per step (named shapes; None: unknown)
    offload: str = "none"  # the offload tier priced in (`offload_cost.py`); `persistent` is then the device's
    host_bytes: int = 0  # per rank in host memory under that tier

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the whole world (every data-parallel rank's batch)."""
        if self.tokens is None or not self.step_s:
            return None
        return self.tokens * (self.world_size // self.tp) / self.step_s

    @property
    def exposed_pct(self) -> float:
        return 100.0 * self.exposed_s / self.step_s if self.step_s else 0.0

    @property
    def extrapolated(self) -> bool:
        return len(self.traced_blocks) > 1

    def describe(self) -> str:
        traced = (
            f"traced {', '.join(map(str, self.traced_blocks))} of {self.n_layers} blocks, extrapolated"
            if self.extrapolated
            else "traced in full"
        )
        return (
            f"{self.model} at world {self.world_size} on {self.device.name}: step {self.step_s * 1e3:.2f} ms, "
            f"exposed communication {self.exposed_pct:.1f}%, peak memory {self.peak_bytes / 2**30:.2f} GiB/rank "
            f"({traced}){self.offload_note()}"
        )

    def offload_note(self) -> str:
        """ ", offload all: 12.34 GiB/rank in host memory" (empty without offload)."""
        if self.offload == "none":
            return ""
        return f", offload {self.offload}: {self.host_bytes / 2**30:,.2f} GiB/rank in host memory"


def result_of(
    traced: Traced,
    *,
    model: str,
    world_size: int,
    device: cost.DeviceProfile,
    trace_s: float,
    tp: int,
    ac: str,
    tokens: int | None,
) -> DryRunResult:
    """The result of a step traced and costed as `traced`."""
    numbers = estimate(traced.costed, blocks=traced.blocks, n_layers=traced.n_layers)
    persistent = traced.persistent
    return DryRunResult(
        model=model,
        world_size=world_size,
        device=device,
        n_layers=traced.n_layers,
        traced_blocks=traced.blocks,
        step_s=numbers.step_s,
        exposed_s=numbers.exposed_s,
        peak_bytes=persistent.params_bytes + persistent.optimizer_bytes + numbers.transient_bytes,
        persistent=persistent,
        transient_parts=numbers.parts,
        report=traced.report,
        trace_s=trace_s,
        tp=tp,
        ac=ac,
        tokens=tokens,
    )


def dry_run(
    model: str | ModelShape | Callable[[], tuple[nn.Module, Any]],
    *,
    world_size: int,
    device: str | cost.DeviceProfile = "h100",
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    shard_size: int | None = None,
    mp_policy: simplefsdp.MixedPrecisionPolicy | None = None,
    passes: simplefsdp.PassConfig | None = simplefsdp.PassConfig(),
    batch: int | None = None,
    seq: int | None = None,
    optimizer: str = "adamw",
    max_traced_blocks: int = 8,
    code: bool = False,
    tp: int = 1,
    ac: str = "none",
    offload: str = "none",
) -> DryRunResult:
    """Predict one training step of `model` at `world_size` ranks on `device` (module docstring).

    `model`: a shape name from `shapes.SHAPES`, a `ModelShape`, or a factory returning
    `(unwrapped model, example input)` -- build it on the meta device to trace without memory.
    `mp_policy` defaults to bf16 gathers with fp32 reductions. `batch` / `seq` override a shape's
    per-rank example batch. `code=True` compiles with inductor and keeps its code (the factory must
    then build on the CPU). `tp`: tensor-parallel degree (named shapes; see the module docstring);
    `ac`: activation checkpointing of every block, one of `AC_POLICIES`; `offload`: a tier of
    `simplefsdp.offload.TIERS`, priced on the trace without it ([Note: pricing the host tier] in
    `offload_cost.py`). Needs a process without a process group (it makes its own)."""
    profile = resolve_profile(device)  # fail fast on bad input, before tracing anything
    check_optimizer(optimizer)
    check_batch_and_seq(batch=batch, seq=seq)
    if ac not in AC_POLICIES:
        raise ValueError(f"unknown activation checkpointing {ac!r}; known: {', '.join(AC_POLICIES)}")
    check_tier(profile, offload)
    if tp != 1 and not isinstance(model, (str, ModelShape)):
        raise ValueError("tp > 1 needs a named shape (a factory's model has no tensor-parallel plan here)")
    if mp_policy is None:
        mp_policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shape = model_shape(model) if isinstance(model, str) else model
    name = shape.name if isinstance(shape, ModelShape) else getattr(model, "__name__", type(model).__name__)
    started = time.perf_counter()
    strategy = ShardingStrategy.parse(strategy)
    with fake_world(world_size):
        mesh, tp_mesh = meshes(strategy=strategy, world_size=world_size, shard_size=shard_size, tp=tp)
        settings = TraceSettings(
            mesh=mesh,
            tp_mesh=tp_mesh,
            strategy=strategy,
            ac=ac,
            mp_policy=mp_policy,
            passes=passes,
            profile=profile,
            batch=batch,
            seq=seq,
            optimizer=optimizer,
            code=code,
        )
        traced = trace(shape, settings=settings, max_traced_blocks=max_traced_blocks)
    result = result_of(
        traced,
        model=name,
        world_size=world_size,
        device=profile,
        trace_s=time.perf_counter() - started,
        tp=tp,
        ac=ac,
        tokens=shape.example_input(batch=batch, seq=seq).numel() if isinstance(shape, ModelShape) else None,
    )
    result = with_offload(result, tier=offload, copy_fraction=copy_fraction(mp_policy), reshards=reshards(strategy, ac))
    logger.info("dry run: %s (%.1f s)", result.describe(), result.trace_s)
    return result
