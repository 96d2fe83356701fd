"""The scoreboard: simplefsdp against DDP, FSDP2 and torch's own compiler passes, same model, same data, one run.

    python bench/scoreboard.py --out bench/results/     # 2 gloo ranks on the CPU (one rank per GPU on CUDA)
    python bench/scoreboard.py --tiny --out /tmp/sb     # the end-to-end check the tests run (seconds, not a result)

Rows (all fp32, FULL_SHARD where sharded, AdamW, the same Llama-style model from the same seed):
  DDP                            `DistributedDataParallel`, eager
  FSDP2 eager                    `fully_shard` per block and at the root (its recommended use)
  FSDP2 + compile per block      each block `torch.compile`d, then `fully_shard` per block and root (as
                                 torchtitan and the FSDP2 docs do: hooks stay eager, blocks compile)
  simplefsdp eager               `simplefsdp.wrap`, no compile
  simplefsdp compiled, no passes `wrap(passes=None)` + `torch.compile`: one collective per parameter
  simplefsdp compiled, ours      `wrap()` + `torch.compile`: simplefsdp's bucketing and reordering
  simplefsdp compiled, ours auto the same with the cost-model ("auto") plan for this device's profile
  simplefsdp compiled, torch's   `wrap(passes=None)` + inductor's FX bucketing and overlap reordering

Measurements, per row:
- step time: median of `--steps` steps after `--warmup`, rank 0, forward + backward + optimizer step,
  the rows' steps interleaved behind barriers (see `_harness.interleaved_times`);
- tokens/s: global tokens per step (ranks x batch x seq) over that median;
- compile time: first step minus the median step, compile caches off (eager rows: 0);
- collectives / step: the process group's own collective calls recorded by `torch.profiler` in one
  step (events named `gloo:*` / `nccl:*`): the same counter for eager hooks and compiled code;
- peak memory per rank: see [Note: peak memory]; the table shows the largest over the ranks.

[Note: peak memory]
All rows live in one process (so their steps can be interleaved), so a process-wide high-water mark
cannot tell them apart. Peak = the row's resident state (bytes of this rank's parameters and
optimizer state, exact, plus DDP's gradient buckets, as many bytes as the parameters) + the step's
transient peak, measured in one extra step after the timing: on CUDA `torch.cuda.max_memory_allocated`
above `memory_allocated` before the step; on the CPU the kernel's resident high-water mark (VmHWM,
reset through /proc/self/clear_refs just before the step) above the resident size before it. For
the CPU number to count what a step allocates, glibc returns freed blocks to the kernel in this
phase only: `mallopt(M_MMAP_THRESHOLD, 64 KiB)` (tensors of 64 KiB and more are mmapped and unmapped
when freed) and `malloc_trim(0)` before each measured step. The timing runs first, under glibc's
defaults.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import _scoreboard_report as report
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import TORCH_BUILTIN_OPTIONS, add_model_arguments, interleaved_times, model_args, spawn
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import simplefsdp
from simplefsdp._compat import functorch_config, inductor_config
from simplefsdp.models import Transformer

ROWS = {  # key (for --rows and the JSON) -> label
    "ddp": "DDP",
    "fsdp2": "FSDP2 eager",
    "fsdp2-compile": "FSDP2 + compile per block",
    "simplefsdp-eager": "simplefsdp eager",
    "no-passes": "simplefsdp compiled, no passes",
    "ours": "simplefsdp compiled, our passes",
    "ours-auto": "simplefsdp compiled, our passes (auto plan)",
    "torch-passes": "simplefsdp compiled, torch's passes",
}
EAGER = ("ddp", "fsdp2", "simplefsdp-eager")
TINY = {"layers": 2, "dim": 32, "heads": 4, "ffn": 88, "vocab": 67, "seq": 16, "warmup": 1, "steps": 2}


def _fsdp2(model: nn.Module, *, compile_blocks: bool) -> nn.Module:
    if compile_blocks:
        for i, block in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(block))
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


def _simplefsdp(model: nn.Module, row: str, profile: str) -> nn.Module:
    passes = {
        "simplefsdp-eager": simplefsdp.PassConfig(),
        "ours": simplefsdp.PassConfig(),
        "ours-auto": simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="auto", device=profile)),
    }.get(row)
    simplefsdp.wrap(model, passes=passes)
    if row == "simplefsdp-eager":
        return model
    return torch.compile(model, options=TORCH_BUILTIN_OPTIONS if row == "torch-passes" else None)


def build(row: str, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """(the model whose parameters the optimizer steps, the callable the step runs) for one row."""
    torch.manual_seed(0)
    with device:
        # [Note: one class per row] Dynamo reuses a compiled `forward` for any instance of the same
        # class whose guards pass, and the guards do not see which simplefsdp passes a model has:
        # "ours" and "ours-auto" would share graphs. A subclass per row keeps their compiles apart.
        model = type(f"Transformer_{row}", (Transformer,), {})(model_args(args))
    if row == "ddp":
        return model, DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if row.startswith("fsdp2"):
        return model, _fsdp2(model, compile_blocks=row == "fsdp2-compile")
    return model, _simplefsdp(model, row, "h100" if device.type == "cuda" else "cpu-gloo")


def _state_bytes(row: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    states = sum(
        local(v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return params + states + (params if row == "ddp" else 0)  # DDP keeps gradient buckets as large as the params


@dataclasses.dataclass
class Row:
    step: Callable[[], None]
    state_bytes: Callable[[], int]
    first_step_s: float = 0.0
    collectives: int = 0


def _make_row(row: str, args: argparse.Namespace, device: torch.device) -> Row:
    model, forward = build(row, args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)  # [B, S + 1]

    def step() -> None:
        logits = forward(tokens[:, :-1])  # [B, S, V]
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    result = Row(step=step, state_bytes=lambda: _state_bytes(row, model, optimizer))
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        dist.barrier()
        start = time.perf_counter()
        step()  # compiles forward and backward (compiled rows)
        result.first_step_s = time.perf_counter() - start
    return result


def _count_collectives(step: Callable[[], None]) -> int:
    """Process-group collective calls in one step (see the module docstring)."""
    backend = dist.get_backend()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = Counter(event.name for event in prof.events())
    return sum(n for name, n in names.items() if name.startswith(f"{backend}:"))


_M_MMAP_THRESHOLD = -3
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")
_RSS = re.compile(r"VmRSS:\s+(\d+) kB")


def _status(pattern: re.Pattern) -> int:
    return int(pattern.search(Path("/proc/self/status").read_text()).group(1)) * 1024


def _transient_peak(step: Callable[[], None], device: torch.device, libc: ctypes.CDLL | None) -> int:
    """Bytes a step allocates above what was resident before it; see [Note: peak memory]."""
    gc.collect()
    if device.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - before
    libc.malloc_trim(0)
    before = _status(_RSS)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    step()
    return _status(_HWM) - before


def _memory(rows: dict[str, Row], device: torch.device) -> dict[str, int]:
    libc = None
    if device.type == "cpu":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    peaks = {}
    for name, row in rows.items():
        row.step()  # settle allocations under the new malloc settings
        dist.barrier()
        peaks[name] = row.state_bytes() + _transient_peak(row.step, device, libc)
    return peaks


def _worker(rank: int, args: argparse.Namespace, results: dict) -> None:
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    rows = {}
    for name in args.rows:
        rows[name] = _make_row(name, args, device)
        rows[name].collectives = _count_collectives(rows[name].step)
        if rank == 0:
            print(f"  built {ROWS[name]}: first step {rows[name].first_step_s:.1f}s", flush=True)
    times = interleaved_times({n: r.step for n, r in rows.items()}, warmup=args.warmup, timed=args.steps)
    peaks = _memory(rows, device)
    all_peaks = [None] * dist.get_world_size()
    dist.all_gather_object(all_peaks, peaks)
    if rank == 0:
        tokens = dist.get_world_size() * args.batch * args.seq
        for name, row in rows.items():
            median = statistics.median(times[name])
            compiled = name not in EAGER
            results[name] = {
                "step_time_s": median,
                "step_times_s": times[name],
                "tokens_per_s": tokens / median,
                "peak_memory_bytes": max(p[name] for p in all_peaks),
                "peak_memory_bytes_per_rank": [p[name] for p in all_peaks],
                "compile_s": max(0.0, row.first_step_s - median) if compiled else 0.0,
                "collectives_per_step": row.collectives,
            }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model and 2 timed steps: {TINY}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--world", type=int, default=0, help="ranks; 0: 2 on the CPU, every GPU on CUDA")
    parser.add_argument("--out", default="bench/results", help="directory for scoreboard.json / .md / .png")
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    args.rows = [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    cuda = torch.cuda.is_available()
    args.backend = "nccl" if cuda else "gloo"
    world = args.world or (torch.cuda.device_count() if cuda else 2)
    setup = report.describe_setup(args, world)
    print(setup["summary"], flush=True)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # see simplefsdp/train/launch.py's note
    results = spawn(_worker, args, world=world, port=args.port, backend=args.backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {name: {"label": ROWS[name], **results[name]} for name in args.rows}
    document = {"setup": setup, "rows": rows, "targets": report.targets(rows)}
    (out / "scoreboard.json").write_text(json.dumps(document, indent=2) + "\n")
    table = report.markdown(document)
    (out / "scoreboard.md").write_text(table)
    report.plot(rows, out / "scoreboard.png", title=setup["summary"])
    print(table)
    print(f"wrote {out / 'scoreboard.json'}, {out / 'scoreboard.md'}, {out / 'scoreboard.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
