"""Benchmark: what simplefsdp's passes add to the first (compiling) step, by model depth.

    python bench/compile_time.py                     # 8, 32, 64 and 128 blocks: several minutes
    python bench/compile_time.py --blocks 8,32       # fewer
    python bench/compile_time.py --variant bucket-only   # the passes' parts: bucket-only, reorder-only

One process plays rank 0 of a fake world of 8 (no data moves; compiling is what is measured). A
Llama-style model with dim-64 blocks is wrapped FULL_SHARD and compiled with inductor, compile
caches off; the first forward + backward is timed with the passes off and on, in separate
processes (a process compiles once). "pass" is the time spent inside simplefsdp's pass itself
(forward and backward graphs), timed around its call inside the compile, where inductor's compile
workers share the cores with it; "pass alone" is the same pass run on copies of the graph it was
given, right after (`--repeats` copies, the fastest run; the time spent on the copies is taken out
of the first step); "fake-tensor re-runs" counts the nodes (and
seconds) inductor re-propagates on fake tensors after its post-grad passes (see [Note: where the
pass runs] in `passes/install.py`). Target: the passes add <= 10% at 64 blocks,
and the pass itself stays linear-ish in the graph size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from torch import fx

VARIANTS = {  # name -> PassConfig keyword arguments
    "off": None,
    "default": {},
    "bucket-only": {"reorder": None},
    "reorder-only": {"bucket": None},
}


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` the pass can rewrite (nodes copied, their meta dicts shallow-copied)."""
    new = fx.Graph(owning_module=graph.owning_module)
    new.output(new.graph_copy(graph, {}))
    return new


def _measure(blocks: int, variant: str, repeats: int) -> dict:
    import simplefsdp
    from simplefsdp._compat import FakeTensorUpdater, functorch_config, inductor_config, init_fake_process_group
    from simplefsdp.models import Transformer, TransformerArgs
    from simplefsdp.passes.fsdp_pass import FsdpPass
    from simplefsdp.passes.install import pass_of

    init_fake_process_group(rank=0, world_size=8)
    args = TransformerArgs(vocab_size=256, dim=64, n_layers=blocks, n_heads=4, ffn_dim=176, max_seq_len=64)
    torch.manual_seed(0)
    kwargs = VARIANTS[variant]
    model = simplefsdp.wrap(Transformer(args), passes=None if kwargs is None else simplefsdp.PassConfig(**kwargs))
    spent, alone, aside = [], [], [0.0]  # the pass in the compile, alone on copies; seconds on copies
    graph_pass = pass_of(model)
    if graph_pass is not None:
        run = FsdpPass.__call__

        def timed(self, graph):
            start = time.perf_counter()
            copies = [_copy(graph) for _ in range(repeats)]  # before the pass rewrites it
            aside[0] += time.perf_counter() - start
            start = time.perf_counter()
            run(self, graph)
            spent.append(time.perf_counter() - start)
            start = time.perf_counter()
            runs = []
            for copy in copies:
                begin = time.perf_counter()
                run(self, copy)
                runs.append(time.perf_counter() - begin)
            alone.append(min(runs))
            aside[0] += time.perf_counter() - start

        graph_pass.__class__ = type("TimedFsdpPass", (FsdpPass,), {"__call__": timed})
    updates = [0, 0.0]  # nodes inductor re-ran on fake tensors after its post-grad passes, seconds
    if FakeTensorUpdater is not None:
        rerun = FakeTensorUpdater.incremental_update

        def counted(self):
            start = time.perf_counter()
            nodes = rerun(self)
            updates[0] += nodes
            updates[1] += time.perf_counter() - start
            return nodes

        FakeTensorUpdater.incremental_update = counted
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    compiled = torch.compile(model)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        start = time.perf_counter()
        compiled(tokens).sum().backward()
        first = time.perf_counter() - start - aside[0]
    return {
        "blocks": blocks,
        "variant": variant,
        "first_step_s": first,
        "pass_s": spent,
        "pass_alone_s": alone,
        "fake_updates": updates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="8,32,64,128")
    parser.add_argument("--variant", default="default", choices=[v for v in VARIANTS if v != "off"])
    parser.add_argument("--repeats", type=int, default=3, help="copies of each graph the pass runs on alone")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "blocks,variant": measure in this process
    args = parser.parse_args()
    if args.one:
        blocks, variant = args.one.split(",")
        print(json.dumps(_measure(int(blocks), variant, args.repeats)))
        return
    print(
        "| blocks | first step, no passes | first step, passes | added | pass in the compile (fwd + bwd) "
        f"| pass alone, fastest of {args.repeats} (fwd + bwd) | fake-tensor re-runs, no passes / passes |"
    )
    print("|---|---|---|---|---|---|---|")
    for blocks in (int(b) for b in args.blocks.split(",")):
        runs = {}
        for variant in ("off", args.variant):
            command = [sys.executable, __file__, "--one", f"{blocks},{variant}", "--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        off, on = runs["off"]["first_step_s"], runs[args.variant]["first_step_s"]
        own, alone = runs[args.variant]["pass_s"], runs[args.variant]["pass_alone_s"]
        (n_off, s_off), (n_on, s_on) = runs["off"]["fake_updates"], runs[args.variant]["fake_updates"]
        print(
            f"| {blocks} | {off:.1f} s | {on:.1f} s | {100 * (on - off) / off:+.0f}% | "
            f"{sum(own):.2f} s ({' + '.join(f'{s:.2f}' for s in own)}) | "
            f"{sum(alone):.2f} s ({' + '.join(f'{s:.2f}' for s in alone)}) | "
            f"{n_off:,} nodes, {s_off:.1f} s / {n_on:,} nodes, {s_on:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
