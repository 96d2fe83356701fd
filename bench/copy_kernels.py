"""Benchmark the bucket copy ops: GB/s against FSDP2's eager ops, inductor's cat + cast, and plain copy.

    python bench/copy_kernels.py                # needs a CUDA GPU; says so and exits 0 without one
    python bench/copy_kernels.py --cpu          # the CPU implementations (torch ops), a dim-1024 block by default
    python bench/copy_kernels.py --gpu-diagnose # why the Triton copy kernel is below a plain copy (CUDA only;
                                                # exits 2 without one); under a minute on an H100 / H200

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
  quantized copy-in   fp32 shards -> uint8 slot (int8 or float8_e4m3fn codes, block 128: one fp32 scale a block)
      torch.ops.simplefsdp.quant_copy_in; bytes: fp32 read + the slot written
  quantized copy-out  uint8 [world, slot] -> each parameter's full tensor in bf16
      torch.ops.simplefsdp.quant_copy_out; bytes: the gathered slots read + bf16 written
  plain copy: `dst.copy_(src)` of the same number of bytes, the bandwidth ceiling

`--gpu-diagnose` separates the candidate causes of the Triton copy kernel's shortfall against a
plain copy (a Llama-3-8B block at world 8 on an H200: copy-in at 19% and copy-out at 53% of a plain
copy's GB/s, measured through the ops). Each row moves the same elements as the bucket copy, timed two ways: one
call between two CUDA events after a synchronize ("synced": host time to launch included) and
`--reps` calls back to back between two events ("back to back", per call: the GPU's time when the
host keeps ahead). Rows, for the copy-in (pack, fp32 -> bf16) and the copy-out (unpack, bf16, rows = world):

  plain copy                          the same bytes, `dst.copy_(src)`: the ceiling
  op, table cached / table fresh      the whole op; "fresh" empties the device-table cache before
                                      each call, so every call builds and uploads its table
  kernel, 1 segment                   the bucket as one segment: no binary search (one entry)
  kernel, 9 segments, one launch      the block's parameters: a search of 4 steps per tile
  kernel, 9 segments, 9 launches      one launch per parameter: no search, 8 more launches
  kernel, 1024 segments, one launch   as many bytes in 1024 equal segments: a 10-step search per
                                      tile and a partial last tile per segment

Reading it: op >> kernel (synced vs back to back) points at host time (table, dispatch); 1 segment
<< 9 segments, one launch, at the per-tile search; 1024 segments >> 9 at many small segments; all
kernel rows near the op's back-to-back time but far below a plain copy, at the kernel's memory
access itself (tile size, vectorization: see `launch.BLOCK`).

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
from simplefsdp.kernels import quant_ops, quantize, reference

QUANT_BLOCK = 128  # the quantized rows' block: MixedPrecisionPolicy's default gather_block

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


def measure(
    *, shapes: list[tuple[int, ...]], world: int, iters: int, device: str, quantized: bool = False
) -> dict[str, tuple[int, float]]:
    """Median seconds of each op and of its FSDP2 eager counterpart on rank 0's shards of fp32
    `shapes` over `world` ranks, cast to bf16, with the bytes each moves: `{name: (bytes, seconds)}`.
    Names: "plain copy", "copy-in {ours, FSDP2 eager, inductor}", "copy-out {ours, FSDP2 eager}",
    "reduce-scatter copy-in {ours, FSDP2 eager}", and with `quantized` "quantized copy-{in,out}
    {int8, fp8}"."""
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
        lambda: torch.ops.simplefsdp.all_gather_copy_in(shards, chunks, bf16),
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
    if quantized:
        results.update(_measure_quantized(shards, chunks, world, _time))
    return results


def _measure_quantized(shards, chunks, world, time_fns) -> dict[str, tuple[int, float]]:
    """The quantized copy-in (fp32 shards -> this rank's slot) and copy-out (every slot -> bf16)."""
    layout = quantize.slot_layout(chunks, QUANT_BLOCK)
    n_shard, n_full = sum(chunks), world * sum(chunks)
    results, sizes = {}, [world * c for c in chunks]
    for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        slot = quant_ops.QUANT_COPY_IN(shards, chunks, code, QUANT_BLOCK)
        gathered = slot.repeat(world)  # real codes and scales in every slot
        copy_in, copy_out = time_fns(
            lambda code=code: quant_ops.QUANT_COPY_IN(shards, chunks, code, QUANT_BLOCK),
            lambda code=code, gathered=gathered: quant_ops.QUANT_COPY_OUT(
                gathered, chunks, sizes, [1] * len(chunks), world, code, QUANT_BLOCK, torch.bfloat16
            ),
        )
        results[f"quantized copy-in {name}"] = (n_shard * 4 + layout.nbytes, copy_in)
        results[f"quantized copy-out {name}"] = (world * layout.nbytes + n_full * 2, copy_out)
    return results


_DESCRIPTIONS = {
    "copy-in ours": "all-gather copy-in, ours",
    "copy-in FSDP2 eager": "all-gather copy-in, FSDP2 eager (cast, then copy-in)",
    "copy-in inductor": "all-gather copy-in, inductor cat + cast",
    "copy-out ours": "all-gather copy-out, ours",
    "copy-out FSDP2 eager": "all-gather copy-out, FSDP2 eager (split_with_sizes_copy)",
    "reduce-scatter copy-in ours": "reduce-scatter copy-in, ours",
    "reduce-scatter copy-in FSDP2 eager": "reduce-scatter copy-in, FSDP2 eager (cast, then _chunk_cat)",
    "quantized copy-in int8": f"quantized copy-in, int8, block {QUANT_BLOCK} (fp32 -> codes + scales)",
    "quantized copy-out int8": f"quantized copy-out, int8, block {QUANT_BLOCK} (-> bf16)",
    "quantized copy-in fp8": f"quantized copy-in, float8_e4m3fn, block {QUANT_BLOCK}",
    "quantized copy-out fp8": f"quantized copy-out, float8_e4m3fn, block {QUANT_BLOCK} (-> bf16)",
}


def _plans_per_segment(plan):
    """`plan` cut into one single-segment plan per segment (no search in the kernel: one entry)."""
    from simplefsdp.kernels import launch

    for start, end, seg in zip(plan.tile_starts[:-1], plan.tile_starts[1:], plan.segments, strict=True):
        grid = (min(end - start, launch.CUDA_MAX_GRID_X), 1, 1)
        yield launch.LaunchPlan(grid=grid, block=plan.block, tile_starts=(0, end - start), segments=(seg,))


def _kernel_variants(kind: str, chunks: list[int], world: int, device: str) -> tuple[int, dict]:
    """The bytes one bucket copy moves and `{variant: fn}` for `kind` ("pack": this rank's fp32
    shards -> bf16 slot; "unpack": bf16 [world, bucket] -> per-parameter outputs), as in the
    module docstring's `--gpu-diagnose` rows."""
    from simplefsdp.kernels import launch, triton_copy

    bf16, n, rows = torch.bfloat16, sum(chunks), 1 if kind == "pack" else world
    bucket_src = torch.randn(n, device=device) if kind == "pack" else torch.randn(world * n, device=device).to(bf16)
    bucket_dst = torch.empty(n, dtype=bf16, device=device)
    equal = [n // 1024 // 8 * 8] * 1023
    layouts = {"1 segment": [n], "9 segments": chunks, "1024 segments": [*equal, n - sum(equal)]}

    def copy(split: list[int]):
        """Plan, sources and destinations of one launch over the bucket cut into `split`."""
        if kind == "pack":
            plan = launch.plan_launch(kind="pack", chunks=split, numels=split, rows=1)
            return plan, list(bucket_src.split(split)), [bucket_dst] * len(split)
        outs = [torch.empty(world * c, dtype=bf16, device=device) for c in split]
        plan = launch.plan_launch(kind="unpack", chunks=split, numels=[o.numel() for o in outs], rows=world)
        return plan, [bucket_src] * len(split), outs

    if kind == "pack":
        shards = list(bucket_src.split(chunks))
        op = functools.partial(torch.ops.simplefsdp.all_gather_copy_in, shards, chunks, bf16)
        nbytes = n * (4 + 2)
    else:
        sizes = [world * c for c in chunks]
        op = functools.partial(
            torch.ops.simplefsdp.all_gather_copy_out, bucket_src, chunks, sizes, [1] * len(chunks), world
        )
        nbytes = rows * n * (2 + 2)
    plain_src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    plain_dst = torch.empty_like(plain_src)
    variants = {
        "plain copy (same bytes)": lambda: plain_dst.copy_(plain_src),
        "op, table cached": op,
        "op, table fresh each call": lambda: (triton_copy._tables.clear(), op()),
    }
    for name, split in layouts.items():
        plan, srcs, dsts = copy(split)
        variants[f"kernel, {name}, one launch"] = functools.partial(triton_copy.launch_bucket, plan, srcs, dsts)
        if name == "9 segments":
            singles = [(p, [s], [d]) for p, s, d in zip(_plans_per_segment(plan), srcs, dsts, strict=True)]
            variants["kernel, 9 segments, 9 launches"] = lambda singles=singles: [
                triton_copy.launch_bucket(*single) for single in singles
            ]
    return nbytes, variants


def diagnose(*, world: int, iters: int, reps: int, device: str = "cuda", dim: int = 4096) -> list[str]:
    """Markdown rows of the `--gpu-diagnose` table (module docstring) for one block at `dim`."""
    shapes = block_shapes(dim=dim, heads=max(1, dim // 128), kv_heads=max(1, dim // 512), ffn=dim * 7 // 2)
    chunks = [reference.chunk_numel(s, world) for s in shapes]
    cuda = device == "cuda"
    lines = []
    for kind, what in (
        ("pack", "all-gather copy-in (fp32 -> bf16)"),
        ("unpack", f"all-gather copy-out (bf16, {world} rows)"),
    ):
        nbytes, variants = _kernel_variants(kind, chunks, world, device)
        synced = _timed(*variants.values(), iters=iters, cuda=cuda)
        repeated = [lambda fn=fn: [fn() for _ in range(reps)] for fn in variants.values()]
        back_to_back = [t / reps for t in _timed(*repeated, iters=max(3, iters // 5), cuda=cuda)]
        ceiling = nbytes / back_to_back[0]
        lines.append(f"| **{what}**, {nbytes / 1e6:.0f} MB moved | | | |")
        for name, one, many in zip(variants, synced, back_to_back, strict=True):
            gbs = nbytes / many
            lines.append(
                f"| {name} | {one * 1e6:.0f} us | {many * 1e6:.0f} us | {gbs / 1e9:.0f} GB/s ({gbs / ceiling:.0%}) |"
            )
    return lines


def _diagnose_main(args) -> int:
    if not torch.cuda.is_available():
        print("bench/copy_kernels.py --gpu-diagnose: no CUDA device here; it measures the Triton kernel on a GPU.",
              file=sys.stderr)  # fmt: skip
        return 2
    from simplefsdp.kernels import copy_ops, triton_copy

    if not copy_ops._use_triton(torch.empty(1, device="cuda")):
        why = triton_copy.supports(torch.device("cuda"))
        print(f"bench/copy_kernels.py --gpu-diagnose: the Triton kernel does not run here ({why}).", file=sys.stderr)
        return 2
    lines = diagnose(world=args.world, iters=args.iters, reps=args.reps, dim=args.dim or 4096)
    print(f"{torch.cuda.get_device_name()}, Llama-3-8B block, world {args.world}: the Triton copy kernel's variants")
    print(f"| variant | synced, one call | back to back (x{args.reps}), per call | bandwidth (of plain copy) |")
    print("|---|---|---|---|")
    print("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cpu", action="store_true", help="measure the CPU implementations instead (torch ops)")
    parser.add_argument("--dim", type=int, help="model dim of the block (default: 4096 on a GPU, 1024 with --cpu)")
    parser.add_argument("--gpu-diagnose", action="store_true", help="the Triton copy kernel's variants (CUDA only)")
    parser.add_argument("--reps", type=int, default=20, help="calls per back-to-back timing of --gpu-diagnose")
    args = parser.parse_args()
    if args.gpu_diagnose:
        return _diagnose_main(args)
    if not torch.cuda.is_available() and not args.cpu:
        print("bench/copy_kernels.py needs a CUDA GPU (it measures GPU memory bandwidth); none here, nothing run.")
        print("(`--cpu` measures the CPU implementations of the same ops instead.)")
        return 0
    if args.cpu:
        torch.set_num_threads(1)  # one core: timings of a shared 2-core machine are otherwise thread-contention noise
    dim = args.dim or (1024 if args.cpu else 4096)
    shapes = block_shapes(dim=dim, heads=max(1, dim // 128), kv_heads=max(1, dim // 512), ffn=dim * 7 // 2)
    results = measure(
        shapes=shapes, world=args.world, iters=args.iters, device="cpu" if args.cpu else "cuda", quantized=True
    )
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
