"""`simplefsdp precompile [train flags]`: compile a training job ahead of its ranks, into its
compile-cache entry, in one process.

    simplefsdp precompile --compile-cache ship/ --n-layers 2 --nproc 2
    simplefsdp train --compile-cache ship/ --n-layers 2 --nproc 2       # every rank loads it

Every flag of `simplefsdp train` works, and the job is the one `train` with the same flags runs: the
model is built as train builds it (`loop.build_model`), at the job's world size (`--nproc`; by default
the ranks train would spawn here), and one forward and backward compile every graph of a training
step into the job's entry (`simplefsdp/compile_cache.py`), sealed with its manifest. On the CPU the
process uses the intra-op threads of one spawned rank (a share of the cores; `OMP_NUM_THREADS`
where set, as under torchrun): inductor generates CPU code for a thread count, and keys on it.

[Note: one process compiles for every rank]
The process joins the fake process group as rank 0 of the job's world: collectives trace as the
job's do but move no data. The pass buckets on the fake group as for the job's real backend (gloo on
the CPU, NCCL on CUDA: `passes.backend.simulating`), and its cache tag is that backend's
(`passes.backend.cache_tag`), so the graphs and their keys are those the job's ranks build: the
ranks' compiles then hit inductor's and AOTAutograd's caches (the shared-artifact test counts the
hits on both ranks). Rank 1 hits rank 0's entries only where the graphs hold no rank: even 1-D shards.

Exit codes: 0 compiled (or the entry was already there: one line says so); 2 a bad flag or setting.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence

from simplefsdp.train.config import ConfigError, TrainConfig, build_parser, check_world, parse_args

__all__ = ["Precompiled", "main", "precompile"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precompiled:
    """What `precompile` left: the entry's folder and key, its size, the seconds, the stage counts."""

    path: str
    key: str
    size_bytes: int
    seconds: float
    counts_line: str
    already: bool  # the entry was there, sealed for this job: nothing compiled

    def line(self) -> str:
        if self.already:
            return f"already precompiled: {self.path} (key {self.key}), {self.size_bytes / 2**20:.1f} MiB"
        return (
            f"precompiled {self.path} (key {self.key}): {self.size_bytes / 2**20:.1f} MiB in {self.seconds:.1f} s; "
            f"{self.counts_line}"
        )


def precompile(config: TrainConfig, *, world_size: int, device_type: str) -> Precompiled:
    """Compile `config`'s training step for `world_size` ranks into its entry (see the module docstring).
    Joins the fake process group for the call; ConfigError for a job that cannot be built."""
    import torch
    import torch.distributed as dist

    from simplefsdp._compat import init_fake_process_group
    from simplefsdp.compile_cache import CacheEntry, StageCounts, job_manifest
    from simplefsdp.inspect.record import recording
    from simplefsdp.passes import cost
    from simplefsdp.passes.backend import simulating
    from simplefsdp.passes.install import pass_of
    from simplefsdp.ranks import spawned_rank_threads
    from simplefsdp.train import comm
    from simplefsdp.train.evaluate import lm_loss
    from simplefsdp.train.job_cache import keep_summary
    from simplefsdp.train.loop import build_model, check_model, mesh_dims, profile_name, token_batches
    from simplefsdp.train.offload_auto import plan_for

    check_world(config, world_size)
    check_model(config)
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(spawned_rank_threads(world_size))  # as each rank train spawns: a key field
    began = time.perf_counter()
    entry = CacheEntry.for_job(
        manifest=job_manifest(config, device_type=device_type, mesh=mesh_dims(config, world_size)),
        directory=config.compile_cache,
    )
    if entry.open():
        return Precompiled(
            path=str(entry.path),
            key=entry.key,
            size_bytes=entry.size_bytes(),
            seconds=0.0,
            counts_line="",
            already=True,
        )
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    plan = plan_for(config, world_size=world_size, device_type=device_type) if config.offload == "auto" else None
    init_fake_process_group(rank=0, world_size=world_size)
    try:
        with simulating("nccl" if device_type == "cuda" else "gloo"), entry.active():
            before = StageCounts.now()
            setup = build_model(config, device, offload_plan=plan)
            tokens = next(token_batches(config, setup)).to(device)  # [B, S + 1]
            with recording(pass_of(setup.model), caches=True) as graphs:  # as train's first step records
                lm_loss(setup.step_fn, tokens).backward()
            counts = StageCounts.now().since(before)
            summary = comm.summarize(setup.model, graphs, profile=cost.profile(profile_name(config, device)))
        if summary.traced:
            keep_summary(entry, summary)
        entry.seal()
    finally:
        dist.destroy_process_group()
    return Precompiled(
        path=str(entry.path),
        key=entry.key,
        size_bytes=entry.size_bytes(),
        seconds=time.perf_counter() - began,
        counts_line=counts.line(),
        already=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        parser = build_parser()
        parser.prog = "simplefsdp precompile"
        parser.description = (
            "Compile a training job ahead of its ranks into its compile-cache entry (in one process); "
            "`simplefsdp train` with the same flags then loads it. Takes every flag of `simplefsdp train`."
        )
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(args)
        if config.backend == "eager":
            raise ConfigError("backend eager compiles nothing to precompile: use inductor or aot_eager")
        from simplefsdp.ranks import spawn_world

        device_type = config.device_type()
        done = precompile(config, world_size=spawn_world(config.nproc, device_type), device_type=device_type)
    except ConfigError as err:
        print(f"simplefsdp precompile: error: {err}", file=sys.stderr)
        return 2
    print(done.line())
    return 0
