"""Peak host memory of meta-device init + `simplefsdp.materialize` per rank, against the full model.

    python bench/meta_init.py            # 2 gloo ranks on the CPU, ~100M-parameter Llama-style model

Each rank reports its peak resident memory (`ru_maxrss`) growth over materialization, next to
the full model's fp32 size and its own shard's size. Expected: shard + one full parameter at a
time (the largest), far below the full model.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist
from _harness import spawn

import simplefsdp
from simplefsdp.models import Transformer, TransformerArgs


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _worker(rank: int, args: argparse.Namespace, results: dict) -> None:
    world = dist.get_world_size()
    model_args = TransformerArgs(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=16, ffn_dim=4 * args.dim, max_seq_len=64
    )
    with torch.device("meta"):
        model = Transformer(model_args)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    simplefsdp.wrap(model)
    before = _peak_rss_bytes()
    torch.manual_seed(0)
    largest = simplefsdp.materialize(model)
    grown = _peak_rss_bytes() - before
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    for r in range(world):
        if r == rank:
            print(
                f"| {rank} | {full / 2**20:.0f} MiB | {shard / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB "
                f"| {grown / 2**20:.0f} MiB | {grown / full:.2f} |",
                flush=True,
            )
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    print(
        "| rank | full model | this rank's shards | largest temporary full parameter "
        "| peak RSS growth | growth / full |"
    )
    print("|---|---|---|---|---|---|")
    spawn(_worker, args, world=2)


if __name__ == "__main__":
    main()
