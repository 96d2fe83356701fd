"""Where a training job's compile artifacts live, and whether an entry there was made for this job.

    entry = CacheEntry.for_job(manifest=job_manifest(settings, device_type="cpu", mesh=(("dp", 2),)), directory="")
    warm = entry.open()                  # True: the entry existed and its manifest matches this job
    with entry.active():                 # inductor / AOTAutograd / Triton caches read and write there
        loss = compiled(batch); loss.backward()
    entry.seal()                         # write the manifest: the entry is complete

An entry is the folder `<directory>/simplefsdp-<key>/`: inductor's cache directory for the job's
compiles (FX graphs, AOTAutograd entries, generated code, Triton kernels) and `manifest.json`, the
readable fields the key digests. `<directory>` is the one named (`--compile-cache`), else torch's
inductor cache directory (`TORCHINDUCTOR_CACHE_DIR`, or torch's default under the temp directory).

Invariant: an entry whose manifest differs from the job's is never used: `open()` logs one line
naming the first field that differs, empties the entry, and the job compiles afresh into it.

[Note: why a job key on top of torch's cache keys]
Inductor keys its FX graph cache on the graph, its config, the post-grad passes' `uuid()` (the
pass's own: `FsdpPass.uuid`) and the torch / Triton / device versions; AOTAutograd keys its entries
on the traced graph and the inputs' metadata. Those keys keep a graph from being served to another
graph, and they stay the guard of correctness here. What they do not give:
- a directory that holds one job: shipping precompiled artifacts with a job needs the job's entries
  apart from every other compile of the machine, and the size of what is shipped;
- a reason: a foreign or stale artifact is simply a miss in torch's caches, silently recompiled --
  the user who shipped a directory learns nothing about why it did not serve. The manifest says
  which field (torch version, pass fingerprint, world size, a setting) differs, in one line;
- warm or cold before anything compiles: the progress bar and the run folder say which;
- Dynamo: torch keys nothing of its trace (it re-traces on every start; [Note: Dynamo is not cached]).

[Note: Dynamo is not cached]
A warm start still runs Dynamo's trace of the model; the first step's line gives its seconds beside
the backend's (AOTAutograd and inductor loading from their caches): on the default job about 3 s
of an 8 s warm first step, against a 44 s cold one (bench/results/measurements.md, "warm starts").
Torch 2.13's ways to keep the trace too fail on a wrapped model:
`torch._dynamo.config.caching_precompile` raises `PackageError` (it cannot name the code object of
the per-class compile entry `passes/install.py` makes at wrap time), and `torch.compile(...,
fullgraph=True).aot_compile(...)` cannot trace the compile-scope wrapper (an undefined local
`args`), nor, on the user class's forward inside `compile_scope`, pickle the guards on the wrapped
model's class (made at wrap time, not importable by name). `torch.compiler.save_cache_artifacts`
bundles the same inductor / AOTAutograd / Triton entries as the entry folder holds, and Dynamo's
only under `caching_precompile`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from simplefsdp._compat import compile_counters, compile_seconds, inductor_cache_dir, using_inductor_cache_dir

__all__ = [
    "MANIFEST",
    "CacheEntry",
    "StageCounts",
    "first_difference",
    "job_key",
    "job_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PREFIX = "simplefsdp-"

# The settings of `simplefsdp train` that decide no compiled graph (schedules, lengths, paths,
# output): every other setting is part of the job's key, so a new setting is keyed until listed here.
_UNKEYED_SETTINGS = frozenset(
    {
        "steps",
        "lr",
        "lr_schedule",
        "warmup_steps",
        "grad_clip",
        "seed",
        "nproc",
        "device",  # the device type the job resolves it to is keyed
        "init_from",
        "checkpoint_dir",
        "checkpoint_every",
        "keep_last",
        "resume",
        "export_dir",
        "run_dir",
        "metrics_file",
        "plot_every",
        "tensorboard",
        "eval_every",
        "sample_tokens",
        "progress",
        "verbose",
        "compile_cache",
        "precompile",
    }
)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def job_manifest(settings: Any, *, device_type: str, mesh: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """The fields that decide a job's compiled graphs, in the order a difference is reported: the
    pass's code fingerprint, the torch / Triton / Python versions, the device type (on the CPU, with
    this process's intra-op threads: inductor's CPU code is generated for that count), the mesh,
    then every keyed setting of `settings` (a `TrainConfig`) by name."""
    from simplefsdp.passes.fsdp_pass import code_fingerprint

    fields: dict[str, Any] = {
        "simplefsdp_pass": code_fingerprint(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "device": device_type if device_type != "cpu" else f"cpu, {torch.get_num_threads()} threads",
        "mesh": " x ".join(f"{name}={size}" for name, size in mesh),
    }
    for field in dataclasses.fields(settings):
        if field.name not in _UNKEYED_SETTINGS:
            fields[field.name] = getattr(settings, field.name)
    return fields


def job_key(manifest: Mapping[str, Any]) -> str:
    """20 hex digits of a SHA-256 over the manifest's fields: equal manifests, equal keys."""
    text = json.dumps(dict(manifest), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def first_difference(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> str | None:
    """The first field of `wanted` that `found` lacks or holds otherwise, as `field: found X, this job Y`
    (a field only `found` has comes after); None when the two are equal."""
    for name in [*wanted, *(n for n in found if n not in wanted)]:
        if found.get(name) != wanted.get(name):
            return f"{name}: {_shown(found.get(name))} there, {_shown(wanted.get(name))} in this job"
    return None


def _shown(value: Any) -> str:
    return "absent" if value is None else repr(value)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at `path`; None where there is none or it is not a JSON object (a broken entry)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCounts:
    """Cache hits and misses per compile stage over a stretch of a run: inductor's FX graph cache and
    AOTAutograd's cache (each compiled graph counts once), and the frames Dynamo traced (it has no
    cache) with the seconds its tracing took (its frame compiles less the backend's: AOTAutograd
    and inductor, loads from their caches included)."""

    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    autograd_hits: int = 0
    autograd_misses: int = 0
    dynamo_frames: int = 0
    dynamo_s: float = 0.0
    backend_s: float = 0.0

    @classmethod
    def now(cls) -> StageCounts:
        """The process's totals so far (torch counts from its start or its last counter reset)."""
        counters = compile_counters()
        frames_s, backend_s = compile_seconds()
        return cls(
            fxgraph_hits=counters["inductor"]["fxgraph_cache_hit"],
            fxgraph_misses=counters["inductor"]["fxgraph_cache_miss"],
            autograd_hits=counters["aot_autograd"]["autograd_cache_hit"],
            autograd_misses=counters["aot_autograd"]["autograd_cache_miss"],
            dynamo_frames=counters["stats"]["unique_graphs"],
            dynamo_s=frames_s - backend_s,
            backend_s=backend_s,
        )

    def since(self, before: StageCounts) -> StageCounts:
        return StageCounts(**{f: getattr(self, f) - getattr(before, f) for f in _COUNT_FIELDS})

    def line(self) -> str:
        return (
            f"inductor fxgraph {self.fxgraph_hits} hits / {self.fxgraph_misses} misses, aot_autograd "
            f"{self.autograd_hits} hits / {self.autograd_misses} misses ({self.backend_s:.1f} s in the backend); "
            f"dynamo traced {self.dynamo_frames} graphs ({self.dynamo_s:.1f} s)"
        )


_COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(StageCounts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheEntry:
    """One job's entry: `path` = `<directory>/simplefsdp-<key>`, and the manifest it must carry."""

    directory: Path
    key: str
    manifest: Mapping[str, Any]
    named: bool  # the directory was named by the user (not torch's default)

    @classmethod
    def for_job(cls, *, manifest: Mapping[str, Any], directory: str) -> CacheEntry:
        """The job's entry under `directory`, or under torch's inductor cache directory when it is empty."""
        base = Path(directory).expanduser().absolute() if directory else Path(inductor_cache_dir())
        return cls(directory=base, key=job_key(manifest), manifest=dict(manifest), named=bool(directory))

    @property
    def path(self) -> Path:
        return self.directory / f"{_PREFIX}{self.key}"

    def open(self, *, owner: bool = True) -> bool:
        """Whether the entry is warm: sealed with this job's manifest. An entry sealed with another
        manifest is refused (one log line: the first differing field) and, by the `owner` (one
        process per machine), emptied; without an entry, a named directory that holds others says in
        one line how the nearest one differs."""
        found = _read_manifest(self.path / MANIFEST)
        if found is not None:
            difference = first_difference(found, self.manifest)
            if difference is None:
                return True
            logger.warning("compile cache %s: refused (%s); compiling afresh", self.path, difference)
            if owner:
                shutil.rmtree(self.path, ignore_errors=True)
        elif self.named:
            nearest = self._nearest_other()
            if nearest is not None:
                logger.warning(
                    "compile cache %s: no entry for this job (%s: %s); compiling afresh into %s",
                    self.directory,
                    nearest[0].name,
                    nearest[1],
                    self.path.name,
                )
        return False

    def _nearest_other(self) -> tuple[Path, str] | None:
        """Another sealed entry of the directory and how it differs, the one with the fewest differing fields."""
        best: tuple[int, Path, str] | None = None
        for manifest in sorted(self.directory.glob(f"{_PREFIX}*/{MANIFEST}")):
            found = _read_manifest(manifest)
            if found is None or manifest.parent == self.path:
                continue
            count = sum(found.get(n) != self.manifest.get(n) for n in {*found, *self.manifest})
            if best is None or count < best[0]:
                best = (count, manifest.parent, first_difference(found, self.manifest) or "")
        return None if best is None else (best[1], best[2])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, inductor's caches (and Triton's) are the entry's; as they were after."""
        self.path.mkdir(parents=True, exist_ok=True)
        triton = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")
        try:
            with using_inductor_cache_dir(str(self.path)):
                yield
        finally:
            if triton is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = triton

    def seal(self) -> None:
        """Write the manifest, last, so that only a complete entry is ever warm."""
        temporary = self.path / f"{MANIFEST}.tmp{os.getpid()}"
        temporary.write_text(json.dumps(dict(self.manifest), indent=1, default=str) + "\n")
        temporary.replace(self.path / MANIFEST)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def record(self, *, warm: bool, counts: StageCounts) -> dict[str, Any]:
        """What the run folder keeps of the entry and of the compile that used it."""
        return {"dir": str(self.directory), "key": self.key, "warm": warm, **dataclasses.asdict(counts)}
