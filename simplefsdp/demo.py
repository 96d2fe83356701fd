"""The main job until the training CLI exists: train a small Llama-style model on 2 CPU ranks.

    python -m simplefsdp.demo [--steps 100] [--strategy FULL_SHARD] [--backend inductor] [--world-size 2]

Spawns the ranks itself (gloo), wraps the model with `simplefsdp.wrap`, compiles it with
`torch.compile` and trains a character-level language model on a short embedded text: no GPU, no
download. Rank 0 prints the loss, which goes down.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import simplefsdp
from simplefsdp.models import Transformer, TransformerArgs

CORPUS = """\
Sharding a model means that no single worker holds all of it. Each worker keeps one slice of every
weight, and before a layer runs the workers trade slices so that each of them briefly holds the whole
layer. When the layer is done the borrowed slices are dropped again. Gradients travel the other way:
each worker computes a gradient for the whole layer, and the workers add their gradients together
so that each keeps only the sum for its own slice. A compiler that sees these exchanges in the graph
can start the next exchange while the current layer is still computing, and can pack many small
exchanges into one large one. That is the whole idea: keep the model code plain, and let the
compiler schedule the communication around the computation.
"""

VOCAB = sorted(set(CORPUS))
SEQ_LEN = 32
BATCH_PER_RANK = 8


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """`[BATCH_PER_RANK, SEQ_LEN + 1]` token windows; the same global batch for any world size."""
    ids = torch.tensor([VOCAB.index(ch) for ch in CORPUS])
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(ids) - SEQ_LEN - 1, (BATCH_PER_RANK * world,), generator=gen)
    mine = starts.chunk(world)[rank]
    return torch.stack([ids[s : s + SEQ_LEN + 1] for s in mine.tolist()])


def _run(rank: int, world: int, init_file: str, opts: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Transformer(
            TransformerArgs(vocab_size=len(VOCAB), dim=64, n_layers=4, n_heads=4, ffn_dim=176, max_seq_len=SEQ_LEN)
        )
        mesh = None
        strategy = simplefsdp.ShardingStrategy.parse(opts.strategy)
        if strategy.is_hybrid:
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, world // 2))
        simplefsdp.wrap(model, mesh, strategy=strategy)
        step_fn = model if opts.backend == "eager" else torch.compile(model, backend=opts.backend)
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
        start = time.perf_counter()
        for step in range(opts.steps):
            tokens = _batch(step, rank, world)
            logits = step_fn(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss := loss.detach())
            if rank == 0 and (step % 10 == 0 or step == opts.steps - 1):
                elapsed = time.perf_counter() - start
                print(f"step {step:4d}  loss {loss.item() / world:.4f}  ({elapsed:.1f}s)", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--strategy", default="FULL_SHARD", help=", ".join(simplefsdp.ShardingStrategy.__members__))
    parser.add_argument("--backend", default="inductor", help="eager, aot_eager or inductor")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    opts = parser.parse_args(argv)
    simplefsdp.ShardingStrategy.parse(opts.strategy)  # fail before spawning on a bad name
    print(
        f"training a {len(VOCAB)}-symbol character model: {opts.world_size} ranks (gloo, CPU), "
        f"{opts.strategy}, backend={opts.backend}; the first step includes compilation",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(opts.world_size, os.path.join(tmp, "pg"), opts), nprocs=opts.world_size)


if __name__ == "__main__":
    main()
