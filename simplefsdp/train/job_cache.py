"""The compile cache of one `simplefsdp train` run, on every rank: its entry, warm or cold, and the
first step's cache hits.

    with job_cache(config, device=device, mesh=(("dp", 2),)) as cache:   # None for backend eager
        before = StageCounts.now(); step(); cache.compiled(StageCounts.now().since(before))

Within the block inductor caches into the job's entry (`simplefsdp/compile_cache.py`). Warm: the
entry was sealed with this job's manifest before the run. With `--precompile` and a cold entry,
one process per machine (local rank 0) first runs `simplefsdp precompile` for the job while the
other ranks wait, so the ranks then load what it compiled: the job compiles once, not once per rank.
A failed precompile is logged in one line and every rank compiles for itself, as without the flag.
Invariant: only local rank 0 writes the manifest or empties a refused entry; every rank sees the
entry's state after it has (a barrier follows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from simplefsdp.compile_cache import CacheEntry, StageCounts, job_manifest
from simplefsdp.train.comm import CommSummary
from simplefsdp.train.config import TrainConfig, to_toml

__all__ = ["JobCache", "job_cache", "keep_summary", "kept_summary", "local_rank"]

logger = logging.getLogger(__name__)


def local_rank() -> int:
    """This rank's index on its machine: torchrun's LOCAL_RANK, else (spawned ranks) the global rank."""
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


@dataclasses.dataclass(kw_only=True)
class JobCache:
    """The run's entry, whether it was warm before the run, and whether this run precompiled it."""

    entry: CacheEntry
    warm: bool
    precompiled: bool = False
    record: dict[str, Any] | None = None  # set by `compiled`: what the run folder keeps

    @property
    def label(self) -> str:
        """What the progress bar shows while the first step compiles."""
        return "compile (warm)" if self.warm or self.precompiled else "compile (cold)"

    def compiled(self, summary: CommSummary, counts: StageCounts) -> tuple[CommSummary, str]:
        """After the first step: the step's communication summary -- `summary` when its graphs were
        traced (local rank 0 keeps it in the entry, then seals a cold entry), else the one the entry
        keeps -- and the line that says what hit; the record for the run folder is kept."""
        if summary.traced and local_rank() == 0:
            keep_summary(self.entry, summary)
        elif not summary.traced:
            summary = kept_summary(self.entry)
        if not self.warm and local_rank() == 0:
            self.entry.seal()
        self.record = {**self.entry.record(warm=self.warm, counts=counts), "precompiled": self.precompiled}
        state = "warm" if self.warm else "precompiled by this run" if self.precompiled else "cold"
        return summary, f"compile cache {self.entry.path} ({state}): {counts.line()}"


_SUMMARY = "train-comm.json"  # in the entry: the traced step's CommSummary, for the runs that load it


def keep_summary(entry: CacheEntry, summary: CommSummary) -> None:
    """Keep the traced step's communication summary in `entry` (before it is sealed)."""
    (entry.path / _SUMMARY).write_text(json.dumps(dataclasses.asdict(summary)) + "\n")


def kept_summary(entry: CacheEntry) -> CommSummary:
    """The summary `keep_summary` kept in `entry`; one that says it is missing where none was kept."""
    try:
        return CommSummary(**json.loads((entry.path / _SUMMARY).read_text()))
    except (OSError, ValueError, TypeError):
        return CommSummary(traced=False, from_cache=True)


def _precompile_here(config: TrainConfig, entry: CacheEntry, world_size: int) -> str | None:
    """Run `simplefsdp precompile` for this job in a child process; None, or why it failed (one line)."""
    logger.info("precompile: compiling the job in one process into %s; the ranks wait", entry.path)
    with tempfile.TemporaryDirectory(prefix="simplefsdp-precompile-") as folder:
        settings = os.path.join(folder, "config.toml")
        with open(settings, "w") as file:
            file.write(to_toml(config))
        command = [sys.executable, "-m", "simplefsdp.cli", "precompile", "--config", settings]
        command += ["--nproc", str(world_size), "--compile-cache", str(entry.directory), "--no-precompile"]
        threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}  # this rank's: part of the key
        done = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, **threads})
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return f"exit {done.returncode}: {lines[-1] if lines else 'no output'}"


@contextlib.contextmanager
def job_cache(
    config: TrainConfig, *, device: torch.device, mesh: Sequence[tuple[str, int]]
) -> Iterator[JobCache | None]:
    """The run's `JobCache`, its entry active for the block; None (and nothing changed) for backend eager."""
    if config.backend == "eager":
        yield None
        return
    manifest = job_manifest(config, device_type=device.type, mesh=mesh)
    entry = CacheEntry.for_job(manifest=manifest, directory=config.compile_cache)
    owner = local_rank() == 0
    warm = entry.open(owner=owner)
    dist.barrier()  # a refused entry is emptied before any rank compiles into it
    precompiled = False
    if not warm and config.precompile:
        failure = _precompile_here(config, entry, dist.get_world_size()) if owner else None
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)  # the ranks wait for their machine's precompile
        for rank, reason in enumerate(failures):
            if reason is not None:
                logger.warning("precompile on rank %d failed (%s); every rank compiles for itself", rank, reason)
        precompiled = all(reason is None for reason in failures)
    with entry.active():
        yield JobCache(entry=entry, warm=warm, precompiled=precompiled)
