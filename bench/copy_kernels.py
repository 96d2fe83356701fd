"""Benchmark the bucket copy ops: GB/s against FSDP2's eager ops, inductor's cat + cast, and plain copy.

    python bench/copy_kernels.py            # needs a CUDA GPU; says so and exits 0 without one
    python bench/copy_kernels.py --cpu      # the CPU implementations (torch ops), a dim-1024 block by default

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
On the CPU (`--cpu`) the target is that each op is no slower than the unfused sequence it
replaces; a custom op's Python dispatch costs some 20-30 us per call, so tiny shapes (`--dim 256`)
measure that overhead rather than the copies.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import torch
import torch.distributed.fsdp
import torch.nn.functional as F

import simplefsdp.kernels  # noqa: F401  (registers torch.ops.simplefsdp.*)
from simplefsdp import _compat
from simplefsdp.kernels import reference

__all__ = ["block_shapes", "measure"]


def block_shapes(dim: int = 4096, heads: int = 32, kv_heads: int = 8, ffn: int = 14336) -> list[tuple[int, ...]]:
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


def _timed(*fns, iters: int, cuda: bool) -> list[float]:
    """Median seconds of each `fn()`: the functions are called in turn, round after round, so drift
    on a shared machine hits them alike. CUDA events on a GPU, wall clock on the CPU (`--cpu`)."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, seconds in zip(fns, times, strict=True):
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - begin)
    return [statistics.median(seconds) for seconds in times]


def _row(name: str, nbytes: int, seconds: float, copy_gbs: float) -> str:
    gbs = nbytes / seconds / 1e9
    return f"| {name} | {seconds * 1e6:.0f} us | {gbs:.0f} GB/s | {gbs / copy_gbs:.0%} |"


def measure(*, shapes: list[tuple[int, ...]], world: int, iters: int, device: str) -> dict[str, tuple[int, float]]:
    """Median seconds of each op and of its FSDP2 eager counterpart on rank 0's shards of fp32
    `shapes` over `world` ranks, cast to bf16, with the bytes each moves: `{name: (bytes, seconds)}`.
    Names: "plain copy", "copy-in {ours, FSDP2 eager, inductor}", "copy-out {ours, FSDP2 eager}",
    "reduce-scatter copy-in {ours, FSDP2 eager}"."""
    dev, bf16 = device, torch.bfloat16
    _time = functools.partial(_timed, iters=iters, cuda=dev == "cuda")
    fulls = [torch.randn(s, device=dev) for s in shapes]
    chunks = [reference.chunk_numel(s, world) for s in shapes]
    shards = [f[: -(-f.shape[0] // world)].contiguous() for f in fulls]  # rank 0's shards
    n_shard, n_full = sum(chunks), world * sum(chunks)
    results = {}

    src = torch.empty(n_shard * 6, dtype=torch.uint8, device=dev)  # 4 + 2 bytes per element moved
    dst = torch.empty_like(src)
    (results["plain copy"],) = [(2 * src.numel(), s) for s in _time(lambda: dst.copy_(src))]

    ag_output = torch.empty(n_full, dtype=bf16, device=dev)
    # FSDP2 keeps its shards padded; it casts each, then copies them into this rank's slot
    padded = [F.pad(s.reshape(-1), (0, c - s.numel())) for s, c in zip(shards, chunks, strict=True)]

    def fsdp2_copy_in():
        cast = [p.to(bf16) for p in padded]
        torch.ops.fsdp.all_gather_copy_in(cast, ag_output, chunks, n_shard, 0)  # torch 2.11 and 2.13 signature

    compiled = torch.compile(lambda xs: torch.cat([x.to(bf16).reshape(-1) for x in xs]))
    times = _time(
        lambda: torch.ops.simplefsdp.all_gather_copy_in(shards, chunks, bf16, world, 0),
        fsdp2_copy_in,
        lambda: compiled(shards),
    )
    for name, seconds in zip(("ours", "FSDP2 eager", "inductor"), times, strict=True):
        results[f"copy-in {name}"] = (n_shard * (4 + 2), seconds)

    gathered = torch.randn(n_full, device=dev).to(bf16)

    def fsdp2_copy_out():  # FSDP2 allocates the unsharded parameters' storage at every all-gather
        outs = [torch.empty(world, c, dtype=bf16, device=dev) for c in chunks]
        torch.split_with_sizes_copy(gathered.view(world, -1), chunks, dim=1, out=outs)

    full_numels = [world * c for c in chunks]
    times = _time(
        lambda: torch.ops.simplefsdp.all_gather_copy_out(gathered, chunks, full_numels, [1] * len(chunks), world),
        fsdp2_copy_out,
    )
    for name, seconds in zip(("ours", "FSDP2 eager"), times, strict=True):
        results[f"copy-out {name}"] = (2 * 2 * n_full, seconds)

    rs_bytes = sum(f.numel() for f in fulls) * 4 + n_full * 2
    times = _time(
        lambda: torch.ops.simplefsdp.reduce_scatter_copy_in(fulls, world, bf16, 1.0),
        lambda: _compat.chunk_cat([f.to(bf16) for f in fulls], dim=0, num_chunks=world),
    )
    for name, seconds in zip(("ours", "FSDP2 eager"), times, strict=True):
        results[f"reduce-scatter copy-in {name}"] = (rs_bytes, seconds)
    return results


_DESCRIPTIONS = {
    "copy-in ours": "all-gather copy-in, ours",
    "copy-in FSDP2 eager": "all-gather copy-in, FSDP2 eager (cast, then copy-in)",
    "copy-in inductor": "all-gather copy-in, inductor cat + cast",
    "copy-out ours": "all-gather copy-out, ours",
    "copy-out FSDP2 eager": "all-gather copy-out, FSDP2 eager (split_with_sizes_copy)",
    "reduce-scatter copy-in ours": "reduce-scatter copy-in, ours",
    "reduce-scatter copy-in FSDP2 eager": "reduce-scatter copy-in, FSDP2 eager (cast, then _chunk_cat)",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cpu", action="store_true", help="measure the CPU implementations instead (torch ops)")
    parser.add_argument("--dim", type=int, help="model dim of the block (default: 4096 on a GPU, 1024 with --cpu)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("bench/copy_kernels.py needs a CUDA GPU (it measures GPU memory bandwidth); none here, nothing run.")
        print("(`--cpu` measures the CPU implementations of the same ops instead.)")
        return 0
    if args.cpu:
        torch.set_num_threads(1)  # one core: timings of a shared 2-core machine are otherwise thread-contention noise
    dim = args.dim or (1024 if args.cpu else 4096)
    shapes = block_shapes(dim=dim, heads=max(1, dim // 128), kv_heads=max(1, dim // 512), ffn=dim * 7 // 2)
    results = measure(shapes=shapes, world=args.world, iters=args.iters, device="cpu" if args.cpu else "cuda")
    copy_bytes, copy_s = results.pop("plain copy")
    copy_gbs = copy_bytes / copy_s / 1e9
    rows = [f"| plain copy ({copy_bytes / 2e6:.0f} MB) | {copy_s * 1e6:.0f} us | {copy_gbs:.0f} GB/s | 100% |"]
    for name, (nbytes, seconds) in results.items():
        rows.append(_row(_DESCRIPTIONS[name], nbytes, seconds, copy_gbs))
        if name.endswith("FSDP2 eager"):
            op = name.removesuffix(" FSDP2 eager")
            speedup = seconds / results[f"{op} ours"][1]
            rows.append(f"| {op} speed-up over FSDP2 eager | {speedup:.2f}x | | |")

    where = "CPU, 1 thread" if args.cpu else torch.cuda.get_device_name()
    block = "Llama-3-8B block" if dim == 4096 else f"Llama-style block, dim {dim}"
    params = sum(math.prod(s) for s in shapes)
    print(f"{where}, {block} ({params / 1e6:.1f}M parameters), world {args.world}, fp32 -> bf16")
    print("| op | time (median) | bandwidth | of plain copy |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
