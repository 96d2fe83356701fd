"""Benchmark the bucket copy ops: GB/s against FSDP2's eager ops, inductor's cat + cast, and plain copy.

    python bench/kernels.py            # needs a CUDA GPU; says so and exits 0 without one

Shapes: the parameters of one Llama-3-8B block (dim 4096, 32 heads, 8 KV heads, ffn 14336), fp32
masters, sharded over `--world` ranks (default 8). For each op, bytes moved = bytes read + bytes
written, divided by the median of `--iters` timed calls (CUDA events, after warm-up):

  all-gather copy-in   fp32 shards -> bf16 flat slot
      ours: torch.ops.simplefsdp.all_gather_copy_in      (one pass: read fp32, write bf16 into the slot)
      FSDP2 eager: cast each shard to bf16, then torch.ops.fsdp.all_gather_copy_in (two passes)
      inductor: torch.compile'd `torch.cat([s.to(bf16).reshape(-1) ...])`
  all-gather copy-out  bf16 [world, bucket] -> each parameter's full tensor
      ours: torch.ops.simplefsdp.all_gather_copy_out
      FSDP2 eager: torch.split_with_sizes_copy on the [world, bucket] view, per-parameter outputs
  reduce-scatter copy-in  fp32 full grads -> bf16 [world, bucket], rank chunks interleaved
      ours: torch.ops.simplefsdp.reduce_scatter_copy_in
      FSDP2 eager: cast each grad, then torch._chunk_cat
  plain copy: `dst.copy_(src)` of the same number of bytes, the bandwidth ceiling

Targets (H200): each of ours >= 90% of plain-copy GB/s; copy-in >= 1.5x FSDP2's eager path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed.fsdp
import torch.nn.functional as F

import simplefsdp.kernels  # noqa: F401  (registers torch.ops.simplefsdp.*)
from simplefsdp.kernels import reference


def _block_shapes(dim: int = 4096, heads: int = 32, kv_heads: int = 8, ffn: int = 14336) -> list[tuple[int, ...]]:
    head_dim = dim // heads
    return [
        (dim, dim),  # wq
        (kv_heads * head_dim, dim),  # wk
        (kv_heads * head_dim, dim),  # wv
        (dim, dim),  # wo
        (ffn, dim),  # w1
        (dim, ffn),  # w2
        (ffn, dim),  # w3
        (dim,),  # attention norm
        (dim,),  # ffn norm
    ]


def _time(fn, iters: int) -> float:
    """Median seconds of `fn()`: CUDA events on a GPU, wall clock otherwise (`--cpu-smoke`)."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _row(name: str, nbytes: int, seconds: float, copy_gbs: float) -> str:
    gbs = nbytes / seconds / 1e9
    return f"| {name} | {seconds * 1e6:.0f} us | {gbs:.0f} GB/s | {gbs / copy_gbs:.0%} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cpu-smoke", action="store_true", help="run on the CPU, small shapes: checks the script only")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench/kernels.py needs a CUDA GPU (it measures GPU memory bandwidth); none here, nothing run.")
        return 0
    world, dev, bf16 = args.world, ("cpu" if args.cpu_smoke else "cuda"), torch.bfloat16
    shapes = _block_shapes(dim=256, heads=8, kv_heads=2, ffn=896) if args.cpu_smoke else _block_shapes()
    fulls = [torch.randn(s, device=dev) for s in shapes]
    chunks = [reference.chunk_numel(s, world) for s in shapes]
    shards = [f[: -(-f.shape[0] // world)].contiguous() for f in fulls]  # rank 0's shards
    numels = [f.numel() for f in fulls]
    n_shard, n_full = sum(chunks), world * sum(chunks)

    src = torch.empty(n_shard * 6, dtype=torch.uint8, device=dev)  # 4 + 2 bytes per element moved
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), args.iters)
    copy_gbs = 2 * src.numel() / copy_s / 1e9
    rows = [f"| plain copy ({src.numel() / 1e6:.0f} MB) | {copy_s * 1e6:.0f} us | {copy_gbs:.0f} GB/s | 100% |"]

    ag_in_bytes = n_shard * (4 + 2)
    ours = _time(lambda: torch.ops.simplefsdp.all_gather_copy_in(shards, chunks, bf16, world, 0), args.iters)
    rows.append(_row("all-gather copy-in, ours", ag_in_bytes, ours, copy_gbs))
    ag_output = torch.empty(n_full, dtype=bf16, device=dev)
    # FSDP2 keeps its shards padded; it casts each, then copies them into this rank's slot
    padded = [F.pad(s.reshape(-1), (0, c - s.numel())) for s, c in zip(shards, chunks, strict=True)]

    def fsdp2_copy_in():
        cast = [p.to(bf16) for p in padded]
        torch.ops.fsdp.all_gather_copy_in(cast, ag_output, chunks, n_shard, 0)  # torch 2.13 signature

    fsdp2 = _time(fsdp2_copy_in, args.iters)
    rows.append(_row("all-gather copy-in, FSDP2 eager (cast, then copy-in)", ag_in_bytes, fsdp2, copy_gbs))
    rows.append(f"| copy-in speed-up over FSDP2 eager | {fsdp2 / ours:.2f}x | | |")
    compiled = torch.compile(lambda xs: torch.cat([x.to(bf16).reshape(-1) for x in xs]))
    rows.append(
        _row(
            "all-gather copy-in, inductor cat + cast",
            ag_in_bytes,
            _time(lambda: compiled(shards), args.iters),
            copy_gbs,
        )
    )

    gathered = torch.randn(n_full, device=dev).to(bf16)
    ag_out_bytes = 2 * 2 * n_full
    ours = _time(
        lambda: torch.ops.simplefsdp.all_gather_copy_out(gathered, chunks, [world * c for c in chunks], world),
        args.iters,
    )
    rows.append(_row("all-gather copy-out, ours", ag_out_bytes, ours, copy_gbs))
    outs = [torch.empty(world, c, dtype=bf16, device=dev) for c in chunks]
    split = _time(lambda: torch.split_with_sizes_copy(gathered.view(world, -1), chunks, dim=1, out=outs), args.iters)
    rows.append(_row("all-gather copy-out, FSDP2 eager (split_with_sizes_copy)", ag_out_bytes, split, copy_gbs))

    rs_bytes = sum(numels) * 4 + n_full * 2
    ours = _time(lambda: torch.ops.simplefsdp.reduce_scatter_copy_in(fulls, world, bf16, 1.0), args.iters)
    rows.append(_row("reduce-scatter copy-in, ours", rs_bytes, ours, copy_gbs))
    chunk_cat = _time(lambda: torch._chunk_cat([f.to(bf16) for f in fulls], dim=0, num_chunks=world), args.iters)
    rows.append(_row("reduce-scatter copy-in, FSDP2 eager (cast, then _chunk_cat)", rs_bytes, chunk_cat, copy_gbs))

    where = "CPU smoke run (numbers meaningless)" if args.cpu_smoke else torch.cuda.get_device_name()
    print(f"{where}, Llama-3-8B block, world {world}, fp32 -> bf16")
    print("| op | time (median) | bandwidth | of plain copy |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
