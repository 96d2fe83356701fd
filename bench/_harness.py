"""Pieces the distributed benchmarks share: the model flags, torch's own bucketing options, counting
collectives, interleaved timing, a step's peak memory, spawning the ranks and the header of a
checked-in record.

Scripts in bench/ import it as `_harness` (they run as `python bench/<script>.py`, which puts
bench/ first on the path; the spawned ranks inherit it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simplefsdp import gloo
from simplefsdp.calibrate.high_water import high_water_bytes
from simplefsdp.cpu_memory import keep_freed_memory, return_freed_memory, trim_freed_memory
from simplefsdp.inspect.live_bytes import state_bytes
from simplefsdp.models import TransformerArgs

__all__ = [
    "TORCH_BUILTIN_OPTIONS",
    "add_model_arguments",
    "count_code_launches",
    "interleaved_times",
    "model_args",
    "paired_speedup",
    "record_header",
    "release_freed_memory",
    "spawn",
    "state_bytes",
    "transient_peak",
]

# inductor's own FX bucketing and compute / communication reordering, instead of simplefsdp's passes
TORCH_BUILTIN_OPTIONS = {
    "bucket_all_gathers_fx": "only_fsdp",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}
_LAUNCH = re.compile(r"torch\.ops\._c10d_functional\.(?!wait_tensor)(\w+)\.default\(")


def add_model_arguments(parser: argparse.ArgumentParser, *, steps: int = 15) -> None:
    """The model / batch / timing flags, with the defaults of the benchmarks' 8-block model."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps (the median is reported)")


def model_args(args: argparse.Namespace) -> TransformerArgs:
    return TransformerArgs(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
    )


def count_code_launches(code: list[str]) -> int:
    """Collective launches in inductor's generated code (forward and backward modules)."""
    return sum(len(_LAUNCH.findall(c)) for c in code)


def interleaved_times(steps: Mapping[str, Callable[[], None]], *, warmup: int, timed: int) -> dict[str, list[float]]:
    """Seconds of each timed step of each configuration, on this rank.

    [Note: interleaved timing] one step of each configuration in turn, behind a barrier, so drift
    in a shared machine's load hits every configuration alike.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + timed):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def paired_speedup(baseline: list[float], times: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of `baseline[i] / times[i]` over the timed steps (> 1: faster than baseline).

    With interleaved timing, step i of every configuration ran back to back, so the per-step ratio
    cancels most of the load drift that moves the medians of a shared machine from run to run.
    """
    ratios = sorted(b / t for b, t in zip(baseline, times, strict=True))
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


def release_freed_memory(device: torch.device) -> None:
    """On the CPU, make glibc map blocks of 64 KiB and more on their own and unmap them when freed
    (`simplefsdp.cpu_memory.return_freed_memory`), so the resident high-water mark `transient_peak`
    reads follows what a step allocates more closely -- not exactly: a large block carved from the
    free top of a heap stays resident once freed (see [Note: resident is not allocated] in
    `simplefsdp/calibrate/high_water.py`). Call it after the timing: it undoes what `_rank` set for
    it ([Note: freed memory kept on the CPU] in `simplefsdp/cpu_memory.py`)."""
    if device.type == "cpu":
        return_freed_memory()


def transient_peak(step: Callable[[], None], device: torch.device) -> int:
    """Bytes `step` allocates above what was resident before it, at its peak
    (`simplefsdp.calibrate.high_water.high_water_bytes`); on the CPU after `malloc_trim`, so freed
    memory glibc still held does not hide the step's (call `release_freed_memory` first)."""
    if device.type == "cpu":
        trim_freed_memory()
    return high_water_bytes(step, device)


def _rank(rank: int, world: int, store: str, backend: str, worker: Callable, args: Any, results: dict) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
        keep_freed_memory()  # every row alike: [Note: freed memory kept on the CPU] in simplefsdp/cpu_memory.py
    # CPU rows: gloo with one worker thread ([Note: torch's two gloo workers race] in simplefsdp/gloo.py)
    backend = gloo.backend() if backend == "gloo" else backend
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker(rank, args, results)
    finally:
        dist.destroy_process_group()


def spawn(worker: Callable[[int, Any, dict], None], args: Any, *, world: int = 2, backend: str = "gloo") -> dict:
    """Run `worker(rank, args, results)` on `world` ranks (one GPU each with nccl); returns `results`.

    The ranks meet through a file in a fresh temporary directory, not a TCP port: two benchmarks
    (or a benchmark and a test) running at once cannot collide. A rank that crashes fails the run,
    also after its work ([Note: a rank that dies after finishing] in simplefsdp/ranks.py)."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory(prefix="simplefsdp-bench-") as tmp:
        results = manager.dict()
        store = os.path.join(tmp, "store")
        mp.spawn(_rank, args=(world, store, backend, worker, args, results), nprocs=world, join=True)
        return dict(results)


def _commit() -> str:
    """The checkout's commit, and whether files it tracks differed from it when the run started."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} plus uncommitted changes" if dirty else commit


def record_header(title: str, *, host: str, files: str, argv: list[str] | None = None) -> str:
    """The opening of a result record (`bench/results/*.md`): its title, then the command that made
    it, the commit measured, the host and the date, so a table is never read apart from its run.
    Call it when the run starts (the commit is read then, before the run writes its results)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(os.path.dirname(__file__)))
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- command: `{command}`",
            f"- commit: {_commit()}",
            f"- host: {host} (`{socket.gethostname()}`); torch {torch.__version__}",
            f"- date: {datetime.date.today().isoformat()}",
            f"- files: {files}",
            "",
            "",
        ]
    )
