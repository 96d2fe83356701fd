"""Time what the cost model charges for, on this machine and the current process group.

Every rank runs `measure()` together (the collectives need them all); each timing is the median of
its repeats, and the ranks then agree on the largest (an all-reduce of the times), so every rank
returns the same `Measurements` and the fitted profile does not depend on which rank writes it.

- matmul: `n x n @ n x n` in the compute dtype (bf16 on a GPU, fp32 on the CPU) -> FLOP/s;
- memory: a copy of a large fp32 buffer into another -> bytes read + written per second;
- collectives: all-gather, reduce-scatter and all-reduce of full buffers from a few KiB to tens of
  MiB (hundreds on a GPU) -> the points `fit.py` fits latency and bandwidth to;
- overlap: a matmul loop alone, all-gathers of a bucket-sized buffer of about the same total
  duration alone, and both at once (the all-gathers launched asynchronously, the loop run while
  they are in flight), interleaved round by round ([Note: paired timings]) -> how much of the
  communication time really ran in parallel with compute (see `fit.overlap_share`);
- wake-up: a small all-gather (the functional op and its wait, as compiled graphs issue it) issued
  after a stretch of matmuls, for stretches from about 0.25 to 32 ms, against the same all-gather
  back to back and the matmuls alone, interleaved -> the extra each costs after its group sat idle
  (`fit.fit_wake`; [Note: what a training step adds] in `passes/cost.py`);
- launch: an asynchronous functional all-gather / reduce-scatter / all-reduce at each size, timed
  until it returns to the caller -> the compute time each launch takes (`fit.fit_launch`; [Note:
  what a training step adds]);
- copy-op calls: each bucket copy op (`kernels/copy_ops.py`, the implementation this device runs)
  over 1, 4 and 16 member tensors of 8 elements, timed until it returns -> its fixed seconds and
  seconds per member, what a call costs beyond the bytes it moves (`fit.fit_launch`);
- staging: the memory one all-gather / reduce-scatter / all-reduce of a 64 MiB buffer takes beyond
  its own input and output (on a GPU the caching allocator's peak; on the CPU the kernel's resident
  high-water mark: above glibc's largest dynamic mmap threshold, 32 MiB, a staging buffer is
  always mapped fresh, so the mark sees it) -> bytes per byte of the full buffer
  (`DeviceProfile.staging`);
- capacity: the memory one rank may use -- on a GPU its total memory as the driver reports it, on
  the CPU the host's physical memory over the ranks on it (`LOCAL_WORLD_SIZE`, else all ranks);
- optimizer: one step of AdamW and of SGD with momentum over DTensor parameters sharded over the
  group, as `simplefsdp.wrap` leaves them, for many small and for few large shards -> seconds per
  parameter tensor and per element (`fit.fit_optimizer`);
- compiled compute (it needs the matmul and copy rates): a small model's forward and backward,
  compiled without sharding, against its roofline at those rates -> what compiled compute really
  runs at (`DeviceProfile.compute_scale`; [Note: compute as compiled] in `step_probe.py`);
- step probe, last (it needs the profile the rest fits): the same model's compiled training step,
  without passes, with the default buckets not reordered and with the default plan, measured and
  predicted -> what each collective, and each wait right after a launch, costs a real step beyond
  the rest of the profile (`step_probe.py`, `fit.fit_step_probe`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from simplefsdp._compat import all_gather_single, c10d_functional, reduce_scatter_single
from simplefsdp.calibrate.fit import fit_alpha_beta, profile_from
from simplefsdp.calibrate.high_water import high_water_bytes
from simplefsdp.calibrate.step_probe import probe_compute, probe_steps
from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, REDUCE_SCATTER_COPY_IN
from simplefsdp.passes.cost import COLLECTIVE_KINDS

__all__ = ["Measurements", "measure"]

KIB = 2**10
MIB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurements:
    """Seconds measured on `world_size` ranks (the largest over the ranks), with what was timed."""

    world_size: int
    backend: str
    device: str
    matmul_n: int
    matmul_dtype: str
    matmul_s: float
    copy_bytes: int  # bytes read + written by one copy
    copy_s: float
    collectives: dict[str, list[tuple[int, float]]]  # kind -> [(full buffer bytes, seconds)]
    overlap_compute_s: float
    overlap_comm_s: float
    overlap_both_s: float
    wake: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (idle s, extra s)
    optimizers: dict[str, list[tuple[int, int, float]]] = dataclasses.field(default_factory=dict)
    # name -> [(parameter tensors, elements per rank, seconds per step)]
    staging: dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> bytes per full-buffer byte
    launches: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    # kind -> [(full buffer bytes, seconds until an asynchronous launch returns)]
    copy_calls: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    # copy op -> [(member tensors, seconds until a call on 8-element members returns)]
    capacity_bytes: float | None = None  # memory one rank may use
    compute_probe: tuple[float, float] | None = None  # (roofline seconds, measured seconds) of compiled compute
    step_probe: list[tuple[int, int, float, float]] = dataclasses.field(default_factory=list)
    # [(collectives per step, of which exposed, predicted seconds without the probe's fit, measured seconds)]
    # the host tier (offload), measured beside a GPU only (on a CPU the host is the device):
    host_copy: tuple[int, float, float] | None = None  # (bytes, seconds host to device, device to host), pinned
    host_adamw: tuple[int, float] | None = None  # (fp32 elements, seconds of one CPU AdamW step over them)
    host_capacity_bytes: float | None = None  # host memory one rank may use


@dataclasses.dataclass(frozen=True)
class _Plan:
    sizes: tuple[int, ...]  # full buffer bytes of the collectives
    repeats: int
    matmul_n: int
    copy_bytes: int
    overlap_bytes: int  # full buffer of the all-gathers the overlap is measured with: about a bucket
    # compute before each all-gather: out to the stretches a training step's collectives see
    # between them, where the extra stops growing ([Note: what a training step adds] in passes/cost.py)
    wake_gaps_s: tuple[float, ...] = (0.25e-3, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3)
    wake_rounds: int = 20  # (compute, all-gather) rounds per timing, fewer for the long stretches
    optimizer_shapes: tuple[tuple[int, int], ...] = ((64, 4096), (4, 1 << 20))  # (tensors, elements each)
    paired_repeats: int = 25  # rounds of the overlap and wake-up timings ([Note: paired timings])


_QUICK = _Plan(
    sizes=(16 * KIB, 256 * KIB, 4 * MIB, 16 * MIB),
    repeats=3,
    matmul_n=256,
    copy_bytes=16 * MIB,
    overlap_bytes=MIB,
    wake_gaps_s=(1e-3, 4e-3),
    wake_rounds=5,
    optimizer_shapes=((16, 1024), (2, 1 << 16)),
    paired_repeats=3,
)
_FULL_CPU = _Plan(
    sizes=tuple(4 * KIB * 4**i for i in range(8)), repeats=9, matmul_n=1024, copy_bytes=128 * MIB, overlap_bytes=4 * MIB
)
_FULL_GPU = _Plan(
    sizes=tuple(4 * KIB * 4**i for i in range(11)), repeats=20, matmul_n=8192, copy_bytes=2**30, overlap_bytes=64 * MIB
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# [Note: paired timings]
# The overlap and wake-up numbers are differences of timings (both at once minus each alone), a few
# milliseconds out of tens. Timed as separate medians one after the other, a change in the host's
# load between them lands in the difference whole: calibrations minutes apart can fit overlap shares
# anywhere from 0 to 0.65 (bench/results/measurements.md, "paired timings"). So the timings a difference
# is taken of run interleaved, one round of each per repeat, and the difference is taken within
# each round, then the median over the rounds: a load change between rounds cancels. A single
# round is still noisy on a shared host (one round's overlap share can fall below 0 or near 1), so
# these take more rounds than the other
# timings (`_Plan.paired_repeats`; each round is tens of milliseconds).
def _paired_s(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int) -> list[tuple[float, ...]]:
    """Per repeat, the seconds of each of `fns` in turn (each behind a barrier): one row per round."""
    for fn in fns:
        fn()  # warm-up
    rounds = []
    for _ in range(repeats):
        row = []
        for fn in fns:
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            row.append(time.perf_counter() - start)
        rounds.append(tuple(row))
    return rounds


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median seconds of `fn` over `repeats` runs, after one warm-up (allocations, connections)."""
    return statistics.median(seconds for (seconds,) in _paired_s([fn], device, repeats))


def _collective(kind: str, full_bytes: int, device: torch.device) -> Callable[[], object]:
    world = dist.get_world_size()
    numel = max(world, full_bytes // 4 // world * world)  # fp32 elements of the full buffer, divisible by world
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // world, device=device)
    if kind == "all_gather":
        return lambda: all_gather_single(full, piece)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(piece, full)
    return lambda: dist.all_reduce(full)


# [Note: timing on a busy machine]
# A collective's median over a few repeats can still be swamped by the scheduler: on a host running
# other work, a small all-gather can take longer than one a hundred times its size
# (bench/results/measurements.md, "timing on a busy machine"), and a line through such points falls
# with the size, which no bandwidth explains. The sizes of one kind
# are therefore timed together and agreed over the ranks, and timed again (up to `_ATTEMPTS` times
# in all) while the fit through them has no positive slope. Every rank sees the same agreed times,
# so every rank takes the same decision and the collectives stay matched. Times that still do not
# grow are returned as measured: `profile_from` then refuses them with the fit's error, naming the
# kind, rather than inventing a bandwidth.
_ATTEMPTS = 3


def _collective_times(kind: str, device: torch.device, plan: _Plan) -> list[tuple[int, float]]:
    """`(full buffer bytes, seconds)` of `kind` over `plan.sizes`, agreed over the ranks."""
    for _ in range(_ATTEMPTS):
        times = [_median_s(_collective(kind, size, device), device, plan.repeats) for size in plan.sizes]
        points = list(zip(plan.sizes, _agree(times, device), strict=True))
        try:
            fit_alpha_beta([(float(size), t) for size, t in points])  # the slope's sign does not depend on x's scale
        except ValueError:
            continue
        return points
    return points


def _overlap(device: torch.device, plan: _Plan) -> tuple[float, float, float]:
    """(matmul loop alone, all-gathers alone, both together) seconds, each about 30 ms: `k` all-gathers
    of a bucket-sized buffer launched asynchronously back to back, as a prefetch issues them."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(plan.matmul_n, plan.matmul_n, device=device, dtype=dtype)
    repeats = plan.paired_repeats
    (one,) = _agree([_median_s(lambda: a @ a, device, repeats)], device)  # the ranks must size alike
    loops = max(1, int(0.03 / max(one, 1e-6)))

    def compute() -> None:
        for _ in range(loops):
            a @ a

    world = dist.get_world_size()
    full = torch.ones(plan.overlap_bytes // 4 // world * world, device=device)
    piece = torch.ones(full.numel() // world, device=device)
    single = _median_s(lambda: all_gather_single(full, piece), device, repeats)
    (ratio,) = _agree([loops * one / max(single, 1e-6)], device)  # every rank must launch as many
    count = max(1, round(ratio))

    def gathers() -> list:
        return [all_gather_single(full, piece, async_op=True) for _ in range(count)]

    def comm() -> None:
        for work in gathers():
            work.wait()

    def both() -> None:
        works = gathers()
        compute()
        for work in works:
            work.wait()

    rounds = _paired_s([compute, comm, both], device, repeats)  # [Note: paired timings]
    compute_s = statistics.median(c for c, _, _ in rounds)
    comm_s = statistics.median(m for _, m, _ in rounds)
    saved_s = statistics.median(c + m - b for c, m, b in rounds)  # what running both at once saved
    return compute_s, comm_s, compute_s + comm_s - saved_s


def _issue(kind: str, full_bytes: int, device: torch.device) -> Callable[[], torch.Tensor]:
    """The functional collective of `kind`, as a compiled graph issues it (its wait left to the caller)."""
    world = dist.get_world_size()
    group = dist.group.WORLD.group_name
    numel = max(world, full_bytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // world, device=device)
    if kind == "all_gather":
        return lambda: c10d_functional.all_gather_into_tensor(piece, world, group)
    if kind == "reduce_scatter":
        return lambda: c10d_functional.reduce_scatter_tensor(full, "sum", world, group)
    return lambda: c10d_functional.all_reduce(full, "sum", group)


def _until_return_s(
    call: Callable[[], object], device: torch.device, repeats: int, *, finish: Callable[[object], object] = id
) -> float:
    """The median seconds until `call` returns to the caller (each behind a barrier; what it left
    running, `finish(result)`, outside the timing), after one warm-up."""
    finish(call())
    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        out = call()
        samples.append(time.perf_counter() - start)
        finish(out)
    return statistics.median(samples)


def _launches(device: torch.device, plan: _Plan) -> dict[str, list[tuple[int, float]]]:
    """Per kind and size of `plan`: seconds until the collective returns to the caller (its wait
    outside the timing), agreed over the ranks."""
    result = {}
    for kind in COLLECTIVE_KINDS:
        wait = c10d_functional.wait_tensor
        times = [_until_return_s(_issue(kind, size, device), device, plan.repeats, finish=wait) for size in plan.sizes]
        result[kind] = list(zip(plan.sizes, _agree(times, device), strict=True))
    return result


_COPY_CALL_MEMBERS = (1, 4, 16)  # member tensors of the timed copy-op calls
_COPY_CALL_NUMEL = 8  # elements per member: the call's own cost, not its bytes


def _copy_calls(device: torch.device, plan: _Plan) -> dict[str, list[tuple[int, float]]]:
    """Per bucket copy op and member count: seconds until a call on tiny members returns (for a
    GPU kernel: its launch, not its run), agreed over the ranks."""
    world, n = dist.get_world_size(), _COPY_CALL_NUMEL
    calls = {}
    for members in _COPY_CALL_MEMBERS:
        shards = [torch.ones(n, device=device) for _ in range(members)]
        gathered = torch.ones(world * n * members, device=device)
        grads = [torch.ones(world * n, device=device) for _ in range(members)]
        chunks, sizes, ndims = [n] * members, [world * n] * members, [1] * members
        calls[members] = {
            "all_gather_copy_in": functools.partial(ALL_GATHER_COPY_IN, shards, chunks, torch.float32),
            "all_gather_copy_out": functools.partial(ALL_GATHER_COPY_OUT, gathered, chunks, sizes, ndims, world),
            "reduce_scatter_copy_in": functools.partial(REDUCE_SCATTER_COPY_IN, grads, world, torch.float32, 1.0),
        }
    ops = list(calls[_COPY_CALL_MEMBERS[0]])  # the warm-up call also picks the device's kernel
    times = [_until_return_s(calls[m][op], device, max(plan.repeats, 9)) for op in ops for m in _COPY_CALL_MEMBERS]
    agreed = iter(_agree(times, device))
    return {op: [(members, next(agreed)) for members in _COPY_CALL_MEMBERS] for op in ops}


_WAKE_BYTES = 64 * KIB  # full buffer of the all-gather the wake-up is measured with
_WAKE_ROUNDS_S = 0.16  # compute per timing beyond which a stretch gets fewer rounds (at least 3)
_WAKE_N = 256  # the matmul the idle stretches are made of (about half a millisecond on one CPU core)


def _wake(device: torch.device, plan: _Plan) -> list[tuple[float, float]]:
    """[(compute seconds before each all-gather, extra seconds the all-gather took after it)]."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(_WAKE_N, _WAKE_N, device=device, dtype=dtype)
    (one,) = _agree([_median_s(lambda: a @ a, device, plan.repeats)], device)
    world = dist.get_world_size()
    piece = torch.ones(_WAKE_BYTES // 4 // world, device=device)
    group = dist.group.WORLD.group_name

    def gather() -> None:  # as a compiled graph issues it: the functional op, then its wait
        c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor(piece, world, group))

    points = []
    for gap in plan.wake_gaps_s:
        loops = max(1, round(gap / max(one, 1e-7)))
        rounds = min(plan.wake_rounds, max(3, round(_WAKE_ROUNDS_S / gap)))

        def back_to_back(rounds: int = rounds) -> None:
            for _ in range(rounds):
                gather()

        def compute(loops: int = loops) -> None:
            for _ in range(loops):
                a @ a

        def alone(rounds: int = rounds) -> None:
            for _ in range(rounds):
                compute()

        def both(rounds: int = rounds) -> None:
            for _ in range(rounds):
                compute()
                gather()

        timed = _paired_s([back_to_back, alone, both], device, plan.paired_repeats)  # [Note: paired timings]
        compute_s = statistics.median(c for _, c, _ in timed)
        extra = statistics.median(b - c - g for g, c, b in timed) / rounds
        points.append((compute_s / rounds, extra))
    return points


_STAGING_BYTES = 64 * MIB  # see the module docstring


def _capacity(device: torch.device) -> float | None:
    """See the module docstring; None where the host does not say."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return _host_share()


def _host_share() -> float | None:
    """This host's physical memory over the ranks on it; None where the host does not say."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return float(physical // max(1, local))


def _staging(device: torch.device) -> dict[str, float]:
    """Per kind of collective: bytes it takes beyond its preallocated input and output, per byte of
    its full buffer. On the CPU only where the kernel's counters can be read (Linux), else nothing."""
    if device.type == "cpu" and not Path("/proc/self/clear_refs").exists():
        return {}
    result = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        run = _collective(kind, _STAGING_BYTES, device)
        run()  # connections and first-use allocations
        dist.barrier()
        result[kind] = max(0, high_water_bytes(run, device)) / _STAGING_BYTES
        del run
    return result


_HOST_COPY_BYTES = 256 * 2**20
_HOST_ADAMW_ELEMENTS = 16 * 2**20


def _host_tier(device: torch.device, plan: _Plan) -> dict:
    """The host tier beside a GPU (`Measurements.host_copy`, `host_adamw`, `host_capacity_bytes`):
    pinned copies each way, and the CPU AdamW step that offload runs; nothing on a CPU."""
    if device.type != "cuda":
        return {}
    host = torch.empty(_HOST_COPY_BYTES // 4, pin_memory=True)
    on_device = torch.empty(host.shape, device=device)
    to_device = _median_s(lambda: on_device.copy_(host, non_blocking=True), device, plan.repeats)
    to_host = _median_s(lambda: host.copy_(on_device, non_blocking=True), device, plan.repeats)
    param = torch.nn.Parameter(torch.zeros(_HOST_ADAMW_ELEMENTS))
    param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    optimizer.step()  # creates the state
    cpu = torch.device("cpu")
    step_s = _median_s(optimizer.step, cpu, plan.repeats)
    return {
        "host_copy": (_HOST_COPY_BYTES, to_device, to_host),
        "host_adamw": (_HOST_ADAMW_ELEMENTS, step_s),
        "host_capacity_bytes": _host_share(),
    }


def _optimizers(device: torch.device, plan: _Plan) -> dict[str, list[tuple[int, int, float]]]:
    """Seconds of one optimizer step over DTensor shards, per optimizer and shape of `plan`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    makers = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
        "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    }
    result = {}
    for name, make in makers.items():
        result[name] = []
        for tensors, elements in plan.optimizer_shapes:
            params = []
            for _ in range(tensors):
                full = torch.zeros(elements * world, device=device)
                param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
                param.grad = distribute_tensor(torch.ones_like(full), mesh, [Shard(0)])
                params.append(param)
            optimizer = make(params)
            optimizer.step()  # creates the state: the timed steps are steady-state ones
            result[name].append((tensors, elements, _median_s(optimizer.step, device, plan.repeats)))
    return result


# [Note: timing compiled compute]
# The compiled compute probe sets `compute_scale`, which every prediction of a step multiplies its
# compute by, so one bad timing of it moves them all (bench/results/measurements.md, "timing compiled compute"). The
# ranks finish compiling the probe at different times; a rank that timed it at once could time it
# while another still compiles on the same cores, and it is one forward and backward of about 12 ms,
# so a few repeats span a tenth of a second. So the ranks meet at a barrier first, and the median is
# over three times the usual repeats.


def _agree(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over the ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def measure(*, device: torch.device, quick: bool = False) -> Measurements:
    """Run every timing on every rank of the default process group (collective: call on all ranks)."""
    plan = _QUICK if quick else (_FULL_GPU if device.type == "cuda" else _FULL_CPU)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(plan.matmul_n, plan.matmul_n, device=device, dtype=dtype)
    matmul_s = _median_s(lambda: a @ a, device, plan.repeats)
    src = torch.empty(plan.copy_bytes // 8, device=device)  # fp32: half the bytes are read, half written
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), device, plan.repeats)
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    collectives = {kind: _collective_times(kind, device, plan) for kind in kinds}
    overlap = _overlap(device, plan)
    wake = _wake(device, plan)
    launches = _launches(device, plan)
    copy_calls = _copy_calls(device, plan)
    optimizers = _optimizers(device, plan)
    staging = _staging(device)
    steps = [s for name in optimizers for _, _, s in optimizers[name]]
    flat = [matmul_s, copy_s, *overlap]
    staged = [staging.get(kind, 0.0) for kind in kinds]
    agreed = _agree([*flat, *(v for point in wake for v in point), *steps, *staged], device)
    staged, agreed = agreed[-len(kinds) :], agreed[: -len(kinds)]
    matmul_s, copy_s, compute_s, comm_s, both_s = agreed[:5]
    wake_values = iter(agreed[len(flat) : len(flat) + 2 * len(wake)])
    step_times = iter(agreed[len(flat) + 2 * len(wake) :])
    measured = Measurements(
        world_size=dist.get_world_size(),
        backend=str(dist.get_backend()),
        device=device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        matmul_n=plan.matmul_n,
        matmul_dtype=str(dtype).removeprefix("torch."),
        matmul_s=matmul_s,
        copy_bytes=src.numel() * 4 * 2,
        copy_s=copy_s,
        collectives=collectives,
        overlap_compute_s=compute_s,
        overlap_comm_s=comm_s,
        overlap_both_s=both_s,
        wake=[(next(wake_values), next(wake_values)) for _ in wake],
        optimizers={name: [(t, e, next(step_times)) for t, e, _ in shapes] for name, shapes in optimizers.items()},
        staging=dict(zip(kinds, staged, strict=True)) if staging else {},
        launches=launches,
        copy_calls=copy_calls,
        capacity_bytes=_capacity(device),
        **_host_tier(device, plan),
    )
    if device.type == "cpu":  # [Note: what a training step adds], compute as compiled: the CPU only
        compute = probe_compute(profile=profile_from(measured, name="roofline"), device=device, quick=quick)
        # [Note: timing compiled compute] every rank starts together, over three times the repeats
        dist.barrier()
        (compute_s,) = _agree([_median_s(compute.forward_backward, device, 3 * plan.repeats)], device)
        measured = dataclasses.replace(measured, compute_probe=(compute.roofline_s, compute_s))
    probes = probe_steps(profile=profile_from(measured, name="without the step probe"), device=device, quick=quick)
    seconds = _agree([_median_s(probe.step, device, plan.repeats) for probe in probes], device)
    points = [
        (probe.collectives, probe.exposed, probe.predicted_s, s) for probe, s in zip(probes, seconds, strict=True)
    ]
    return dataclasses.replace(measured, step_probe=points)
