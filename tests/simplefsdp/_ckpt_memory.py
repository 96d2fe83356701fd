"""Peak host memory of full-state import and export, per rank, against the full model.

    python -m tests.simplefsdp._ckpt_memory              # the README's numbers (~760 MiB model)
    python -m tests.simplefsdp._ckpt_memory --small      # what the test runs (~100 MiB model)

Each rank (fresh gloo processes) builds the transformer on the meta device, wraps it (FULL_SHARD)
and allocates its shards (`to_empty`), then measures the peak growth of its anonymous resident
memory (`RssAnon` in /proc/self/status, sampled every 0.2 ms by a thread: what the process
allocated, not the page cache of files it maps) over `import_full_state_dict` (the file written
beforehand by this process) and over `export_full_state_dict`.
Expected: rank 0 one full parameter (import) or one file plus one parameter (export) beyond its
shards; the other ranks one chunk or one parameter. A design that gathered the whole model on
rank 0, or read it on every rank, would grow by the full model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import simplefsdp
from simplefsdp import checkpoint, gloo
from simplefsdp.models import Transformer, TransformerArgs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    args: TransformerArgs
    max_shard_bytes: int


SMALL = Config(  # 72 MiB fp32: 4 MiB embedding and output head, 16 MiB per block (4 MiB FFN matrices)
    args=TransformerArgs(vocab_size=2048, dim=512, n_layers=4, n_heads=8, ffn_dim=2048, max_seq_len=16),
    max_shard_bytes=8 * 2**20,
)
LARGE = Config(  # 762 MiB fp32 (bench/meta_init.py's model): 125 MiB embedding and output head
    args=TransformerArgs(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, ffn_dim=4096, max_seq_len=64),
    max_shard_bytes=256 * 2**20,
)


@dataclasses.dataclass(frozen=True)
class Row:
    rank: int
    full_bytes: int
    shard_bytes: int
    largest_param_bytes: int
    import_growth: int
    export_growth: int


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


@contextlib.contextmanager
def _peak_growth(out: list[int]) -> Iterator[None]:
    """Append to `out` the peak anonymous RSS growth over the block."""
    base, peak, done = _rss_anon_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.0002):
            peak[0] = max(peak[0], _rss_anon_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out.append(max(peak[0], _rss_anon_bytes()) - base)


def _worker(rank: int, world: int, directory: str, config: Config, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(gloo.backend(), init_method=f"file://{directory}/pg", rank=rank, world_size=world)
    with torch.device("meta"):
        model = Transformer(config.args)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    simplefsdp.wrap(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().zero_()  # touch the shards: resident before the measurement, not during it
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    growth: list[int] = []
    with _peak_growth(growth):
        checkpoint.import_full_state_dict(model, f"{directory}/in/model.safetensors")
    with _peak_growth(growth):
        checkpoint.export_full_state_dict(model, f"{directory}/out", max_shard_bytes=config.max_shard_bytes)
    results.put(Row(rank, full, shard, largest, *growth))
    dist.destroy_process_group()


def measure(directory: str | os.PathLike, config: Config, *, world_size: int) -> list[Row]:
    """Write the model's file here, run the ranks in fresh processes, return one row per rank."""
    directory = Path(directory)
    (directory / "in").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    safetensors.torch.save_file(Transformer(config.args).state_dict(), directory / "in" / "model.safetensors")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, str(directory), config, results)) for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    rows: list[Row] = []
    deadline = time.monotonic() + 300
    while len(rows) < len(procs):
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"memory measurement failed: exit codes {[p.exitcode for p in procs]}")
        with contextlib.suppress(queue.Empty):
            rows.append(results.get(timeout=1))
    for proc in procs:
        proc.join(timeout=60)
    return sorted(rows, key=lambda row: row.rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the test's model instead of the large one")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    config = SMALL if args.small else LARGE
    mib = 2**20
    with tempfile.TemporaryDirectory() as directory:
        rows = measure(directory, config, world_size=args.world_size)
    print(f"max_shard_bytes = {config.max_shard_bytes / mib:.0f} MiB")
    print("| rank | full model | its shards | largest parameter | peak growth: import | peak growth: export |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.rank} | {row.full_bytes / mib:.0f} MiB | {row.shard_bytes / mib:.0f} MiB "
            f"| {row.largest_param_bytes / mib:.0f} MiB | {row.import_growth / mib:.0f} MiB "
            f"| {row.export_growth / mib:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
