"""Validate a GPU machine in one command: the gpu tests, the copy kernels' bandwidth, one training step.

    python bench/gpu_check.py          # one CUDA GPU, under 8 minutes (the budget it is built for)
    python bench/gpu_check.py --cpu    # the same code path at tiny shapes on the CPU (the test suite runs it)

Rows print as they are measured (a run cut short keeps what it had); `--tests-log FILE` keeps the gpu
tests' whole output, `--tests-timeout S` bounds them; a failing step row's traceback goes to stderr.

Prints one table:

1. `python -m pytest -m gpu tests/gpu` in a subprocess: its summary line (every CUDA path; without
   CUDA they skip, and the row says so).
2. The copy ops at a Llama-3-8B block (world 8) and at the embedding + norm + output bucket
   (world 2, where one parameter piece exceeds what the first kernel could launch), fp32 -> bf16:
   our GB/s against a plain device copy of the same bytes (target >= 90%) and our speed-up over
   FSDP2's eager sequence (copy-in target >= 1.5x). Measured by `bench/copy_kernels.py`'s `measure`.
3. One training step (forward, backward, AdamW) of a Llama-3-8B-shaped model cut to 2 blocks (dim
   4096, 32 heads, ffn 14336, vocabulary 128256; simplefsdp's model has no grouped-query attention,
   so its k / v projections are 4096 x 4096, not 1024 x 4096), bf16
   parameters / fp32 reduction, batch 1 x 2048, on torch's fake process group at world 8 (one GPU
   plays rank 0; no data moves, so no communication is timed: the rows compare what a compiler can
   win -- copies, casts, fusion, memory): median step time, `torch.cuda.max_memory_allocated` and the
   first step's seconds (it compiles) for simplefsdp compiled with its passes and without them,
   FSDP2 eager, FSDP2 with each block compiled, and simplefsdp's front end with torch's overlap scheduler
   (`aten_distributed_optimizations.enable_overlap_scheduling`) instead of its passes. A row that
   fails says so with the error's first line (the overlap scheduler cannot run on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import inductor_config, init_fake_process_group
from simplefsdp.models import Transformer, TransformerArgs

ROOT = Path(__file__).resolve().parents[1]


def _load_kernel_bench():
    """`bench/copy_kernels.py` by its path, whatever the current directory (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("simplefsdp_bench_kernels", ROOT / "bench" / "copy_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel_bench = _load_kernel_bench()
VOCAB = 128_256
WORLD = 8


def gpu_tests(*, timeout: float, log: Path | None = None) -> str:
    """The summary line of `pytest -m gpu tests/gpu`, e.g. "7 passed in 95.1s"; the whole output to `log`."""
    # -n 0: in one process, the tests one after another (they share the one device and time it)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-n",
        "0",
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        "tests/gpu",
    ]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        if log is not None:
            log.write_text(str(e.stdout or "") + str(e.stderr or ""))
        return f"timed out after {timeout:.0f} s"
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    lines = [
        line.strip("= ") for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)
    ]
    return lines[-1] if lines else f"no summary (exit {done.returncode}): {done.stderr.strip()[-200:]}"


def kernel_rows(*, cpu: bool, iters: int) -> list[tuple[str, str, str]]:
    dim = 64 if cpu else 4096
    vocab = 1000 if cpu else VOCAB
    block = kernel_bench.block_shapes(dim=dim, heads=max(1, dim // 128), kv_heads=max(1, dim // 512), ffn=dim * 7 // 2)
    buckets = {
        f"block, dim {dim}, world 8": (block, 8),
        f"embedding + norm + output, {vocab} x {dim}, world 2": ([(vocab, dim), (dim,), (vocab, dim)], 2),
    }  # fmt: skip
    rows = []
    for name, (shapes, world) in buckets.items():
        results = kernel_bench.measure(shapes=shapes, world=world, iters=iters, device="cpu" if cpu else "cuda")
        copy_bytes, copy_s = results["plain copy"]
        copy_gbs = copy_bytes / copy_s / 1e9
        for op in ("copy-in", "copy-out", "reduce-scatter copy-in"):
            nbytes, ours = results[f"{op} ours"]
            gbs = nbytes / ours / 1e9
            speedup = results[f"{op} FSDP2 eager"][1] / ours
            target = ">= 90% of copy" + (", >= 1.5x FSDP2" if op == "copy-in" else "")
            rows.append(
                (f"{op}, {name}", f"{gbs:.0f} GB/s = {gbs / copy_gbs:.0%} of copy; {speedup:.2f}x FSDP2 eager", target)
            )
    return rows


def _model_args(cpu: bool) -> TransformerArgs:
    if cpu:
        return TransformerArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=176, max_seq_len=32)
    return TransformerArgs(vocab_size=VOCAB, dim=4096, n_layers=2, n_heads=32, ffn_dim=14336, max_seq_len=2048)


def _ours(model, mesh, *, passes: bool):
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    simplefsdp.wrap(model, mesh, mp_policy=policy, passes=simplefsdp.PassConfig() if passes else None)
    return torch.compile(model)


def _fsdp2(model, mesh, *, compile_blocks: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        if compile_blocks:
            model.layers[i] = torch.compile(layer)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


CONFIGS = {
    "simplefsdp compiled, our passes": (lambda m, mesh: _ours(m, mesh, passes=True), contextlib.nullcontext),
    "simplefsdp compiled, no passes": (lambda m, mesh: _ours(m, mesh, passes=False), contextlib.nullcontext),
    "FSDP2 eager": (lambda m, mesh: _fsdp2(m, mesh, compile_blocks=False), contextlib.nullcontext),
    "FSDP2 + compile per block": (lambda m, mesh: _fsdp2(m, mesh, compile_blocks=True), contextlib.nullcontext),
    "simplefsdp front end, torch's overlap scheduler": (
        lambda m, mesh: _ours(m, mesh, passes=False),
        lambda: inductor_config.patch({"aten_distributed_optimizations.enable_overlap_scheduling": True}),
    ),
}


def step_row(name: str, *, cpu: bool, steps: int) -> tuple[str, str, str]:
    """Median step time, peak memory and first-step (compile) time of one configuration, or the error's first line.

    A failure's whole traceback goes to stderr; the row keeps its first line.
    """
    device = "cpu" if cpu else "cuda"
    build, config = CONFIGS[name]
    args = _model_args(cpu)
    torch.compiler.reset()
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(args)
        step_fn = build(model, init_device_mesh(device, (WORLD,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, args.vocab_size, (1, args.max_seq_len + 1), device=device)
        times = []
        with config():
            for i in range(steps + 2):  # 2 warm-up steps (the first compiles)
                if i == 2 and not cpu:
                    torch.cuda.reset_peak_memory_stats()
                begin = time.perf_counter()
                logits = step_fn(tokens[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
                if not cpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - begin)
        memory = "-" if cpu else f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        median = statistics.median(times[2:]) * 1e3
        return name, f"{median:.1f} ms / step, peak {memory}, first step {times[0]:.1f} s", "-"
    except Exception as e:  # a failing row is reported, the others still run
        traceback.print_exc(file=sys.stderr)
        first = (traceback.format_exception_only(e)[-1].strip().splitlines() or ["?"])[0]
        return name, f"failed: {first[:160]}", "-"
    finally:
        if not cpu:
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing"
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls per kernel (default 30; 3 with --cpu)")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps (default 5; 1 with --cpu)")
    parser.add_argument(
        "--tests-timeout", type=float, default=None, help="seconds for the gpu tests (default 240; 60 with --cpu)"
    )
    parser.add_argument("--tests-log", type=Path, default=None, help="write the gpu tests' whole output here")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print(
            "bench/gpu_check.py needs a CUDA GPU; none here, nothing run (`--cpu` runs the same code on tiny shapes)."
        )
        return 0
    begin = time.perf_counter()
    where = "CPU (--cpu: tiny shapes, nothing measured)" if args.cpu else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}")
    print("| check | result | target |\n|---|---|---|", flush=True)

    def emit(*rows: tuple[str, str, str]) -> None:  # row by row: a run cut short keeps what it measured
        print("\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows), flush=True)

    tests_timeout = args.tests_timeout or (60 if args.cpu else 240)
    emit(("gpu tests (pytest -m gpu tests/gpu)", gpu_tests(timeout=tests_timeout, log=args.tests_log), "all passed"))
    emit(*kernel_rows(cpu=args.cpu, iters=args.iters or (3 if args.cpu else 30)))
    init_fake_process_group(rank=0, world_size=WORLD)
    try:
        for name in CONFIGS:
            emit(step_row(name, cpu=args.cpu, steps=args.steps or (1 if args.cpu else 5)))
    finally:
        dist.destroy_process_group()
    print(f"{time.perf_counter() - begin:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
