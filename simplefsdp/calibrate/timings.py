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
  they are in flight) -> how much of the communication time really ran in parallel with compute
  (see `fit.overlap_share`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from simplefsdp._compat import all_gather_single, reduce_scatter_single

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


@dataclasses.dataclass(frozen=True)
class _Plan:
    sizes: tuple[int, ...]  # full buffer bytes of the collectives
    repeats: int
    matmul_n: int
    copy_bytes: int
    overlap_bytes: int  # full buffer of the all-gathers the overlap is measured with: about a bucket


_QUICK = _Plan(sizes=(16 * KIB, 256 * KIB, 4096 * KIB), repeats=3, matmul_n=256, copy_bytes=16 * MIB, overlap_bytes=MIB)
_FULL_CPU = _Plan(
    sizes=tuple(4 * KIB * 4**i for i in range(8)), repeats=9, matmul_n=1024, copy_bytes=128 * MIB, overlap_bytes=4 * MIB
)
_FULL_GPU = _Plan(
    sizes=tuple(4 * KIB * 4**i for i in range(11)), repeats=20, matmul_n=8192, copy_bytes=2**30, overlap_bytes=64 * MIB
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocations, connections, kernels)
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def _overlap(device: torch.device, plan: _Plan, repeats: int) -> tuple[float, float, float]:
    """(matmul loop alone, all-gathers alone, both together) seconds, each about 30 ms: `k` all-gathers
    of a bucket-sized buffer launched asynchronously back to back, as a prefetch issues them."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(plan.matmul_n, plan.matmul_n, device=device, dtype=dtype)
    (one,) = _agree([_median_s(lambda: a @ a, device, repeats)], device)  # the ranks must size alike
    loops = max(1, int(0.03 / max(one, 1e-6)))

    def compute() -> None:
        for _ in range(loops):
            a @ a

    compute_s = _median_s(compute, device, repeats)
    world = dist.get_world_size()
    full = torch.ones(plan.overlap_bytes // 4 // world * world, device=device)
    piece = torch.ones(full.numel() // world, device=device)
    single = _median_s(lambda: all_gather_single(full, piece), device, repeats)
    (ratio,) = _agree([compute_s / max(single, 1e-6)], device)  # every rank must launch as many
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

    return compute_s, _median_s(comm, device, repeats), _median_s(both, device, repeats)


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
    timings = {
        kind: [_median_s(_collective(kind, size, device), device, plan.repeats) for size in plan.sizes]
        for kind in kinds
    }
    overlap = _overlap(device, plan, plan.repeats)
    flat = [matmul_s, copy_s, *overlap, *(t for kind in kinds for t in timings[kind])]
    agreed = _agree(flat, device)
    matmul_s, copy_s, compute_s, comm_s, both_s = agreed[:5]
    times = iter(agreed[5:])
    return Measurements(
        world_size=dist.get_world_size(),
        backend=str(dist.get_backend()),
        device=device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        matmul_n=plan.matmul_n,
        matmul_dtype=str(dtype).removeprefix("torch."),
        matmul_s=matmul_s,
        copy_bytes=src.numel() * 4 * 2,
        copy_s=copy_s,
        collectives={kind: [(size, next(times)) for size in plan.sizes] for kind in kinds},
        overlap_compute_s=compute_s,
        overlap_comm_s=comm_s,
        overlap_both_s=both_s,
    )
