"""Benchmark: simplefsdp's bucketing / reordering passes against no passes and torch's built-in ones.

    python bench/bench_passes.py            # 2 gloo ranks on the CPU, Llama-style model, fp32

Configurations, all FULL_SHARD under `torch.compile(model)` (inductor):
  (a) no passes         `wrap(..., passes=None)`: one all-gather / reduce-scatter per parameter
  (b) simplefsdp        `wrap(...)`: one bucket per block + rest, prefetch and early reductions
  (b') simplefsdp auto  the same with the cost-model plan for the "cpu-gloo" device profile
  (b'') every block     (b) with `compile_regions=False`: every block traced and compiled, as
                        before blocks became nested regions (`simplefsdp/regions.py`)
  (c) torch built-in    `wrap(..., passes=None)` compiled with inductor's own FX bucketing
                        (`bucket_all_gathers_fx="only_fsdp"`, `bucket_reduce_scatters_fx="all"`)
                        and `reorder_for_compute_comm_overlap=True`
Step time is the median over the timed steps (after warm-up) of rank 0's forward + backward +
optimizer step, the configurations' steps interleaved; "vs (c), paired" is the median (and
quartiles) over the timed steps of (c)'s step time over this configuration's in the same round,
which cancels most load drift (`_harness.paired_speedup`); collectives per step are counted in
inductor's generated code of the compiled forward and backward. Targets: (b) faster than (a),
and not slower than (c). The machine is shared: compare ratios within one run, not absolute
times across runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    TORCH_BUILTIN_OPTIONS,
    add_model_arguments,
    count_code_launches,
    interleaved_times,
    model_args,
    paired_speedup,
    spawn,
)

import simplefsdp
from simplefsdp._compat import functorch_config, inductor_config, run_and_get_code
from simplefsdp.models import Transformer

NO_PASSES, TORCH_BUILTIN = "(a) no passes", "(c) torch built-in bucketing + reorder"
CONFIGS = {
    NO_PASSES: ({"passes": None}, {}),
    "(b) simplefsdp passes, default plan": ({}, {}),
    "(b'') simplefsdp passes, default plan, every block compiled": ({"compile_regions": False}, {}),
    "(b') simplefsdp passes, auto plan (cpu-gloo)": (
        {"passes": simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="auto", device="cpu-gloo"))},
        {},
    ),
    TORCH_BUILTIN: ({"passes": None}, TORCH_BUILTIN_OPTIONS),
}


def _compile_config(name: str, args: argparse.Namespace) -> tuple[Callable[[], None], list[str]]:
    """Build, wrap and compile one configuration; returns its training step and inductor's code
    (forward, backward)."""
    wrap_kwargs, inductor_options = CONFIGS[name]
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(model_args(args)), **wrap_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, options=inductor_options or None)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)

    def step() -> None:
        logits = compiled(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, code = run_and_get_code(step)  # compiles forward and backward
    return step, code


def _save_code(directory: str, name: str, rank: int, code: list[str]) -> None:
    """Write one configuration's generated code, e.g. `DIR/b_rank0_forward.py`, for diffing across commits."""
    tag = re.match(r"\((\w+'*)\)", name).group(1).replace("'", "_prime")
    for phase, source in zip(("forward", "backward"), code, strict=True):
        (Path(directory) / f"{tag}_rank{rank}_{phase}.py").write_text(source)


def _worker(rank: int, args: argparse.Namespace, results: dict) -> None:
    steps, collectives = {}, {}
    for name in CONFIGS:
        steps[name], code = _compile_config(name, args)
        collectives[name] = count_code_launches(code)
        if args.save_code:
            _save_code(args.save_code, name, rank, code)
        if rank == 0:
            print(f"  compiled {name}: {collectives[name]} collectives/step", flush=True)
    if args.save_code:
        return
    times = interleaved_times(steps, warmup=args.warmup, timed=args.steps)  # see [Note: interleaved timing]
    if rank == 0:
        results.update({name: (times[name], collectives[name]) for name in CONFIGS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--save-code", metavar="DIR", help="write inductor's code of every configuration and rank to DIR, then stop"
    )
    args = parser.parse_args()
    if args.save_code:
        Path(args.save_code).mkdir(parents=True, exist_ok=True)
    print(f"2 gloo ranks, FULL_SHARD fp32, {args.layers} blocks, dim {args.dim}, batch {args.batch}x{args.seq}")
    results = spawn(_worker, args, world=2)
    if args.save_code:
        print(f"wrote inductor's code to {args.save_code}")
        return
    no_passes, builtin = results[NO_PASSES][0], results[TORCH_BUILTIN][0]
    print("\n| configuration | step time (median) | vs (a) | vs (c), paired [quartiles] | collectives / step |")
    print("|---|---|---|---|---|")
    for name, (times, collectives) in results.items():
        median = statistics.median(times)
        speedup = statistics.median(no_passes) / median
        paired = "{:.3f}x [{:.3f}, {:.3f}]".format(*paired_speedup(builtin, times))
        print(f"| {name} | {median * 1e3:.1f} ms | {speedup:.2f}x | {paired} | {collectives} |")


if __name__ == "__main__":
    main()
