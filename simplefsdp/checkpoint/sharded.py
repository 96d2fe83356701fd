"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic save, verified resharding load.

    path = save_checkpoint(root, step=step, model=model, optimizer=opt, extra={"data_offset": offset})
    resumed = load_checkpoint(root, model=model, optimizer=opt, missing_ok=True)  # the newest good one

Layout of `root` (one training job per root; a filesystem every rank sees, e.g. NFS or Lustre):

    root/step_000000042/         a complete checkpoint (see manifest.py)
        __0_0.distcp ...          DCP data, one file per rank
        .metadata                 DCP metadata (read with an allow-list unpickler, safe_reader.py)
        train_state.json          step, `extra`, optimizer hyperparameters, every rank's RNG states
        manifest.json             every file's size and SHA-256; written last
    root/step_000000043.tmp/     a save in progress, or one a crash interrupted: never loaded

[Note: atomic save]
Every rank writes into `step_N.tmp/` (DCP, files fsynced), rank 0 adds `train_state.json`, the
ranks hash the files and rank 0 writes `manifest.json`, fsyncs it, then renames the directory to
`step_N/` and fsyncs `root`. A rename within one filesystem is atomic, so a reader sees either no
`step_N/` or a complete one; a crash leaves a `.tmp` directory, which the next save removes. Only
after the rename are older checkpoints pruned to `keep_last`, each losing its manifest before its
files, so a half-deleted checkpoint never looks complete. Saving a step that already exists
replaces it (the old copy is removed just before the rename).

[Note: loading is placement-agnostic]
The state is saved as DTensors, which DCP stores as chunks at global offsets. Loading asks for the
live model's DTensors, whatever their mesh and placements, and DCP reads the overlapping chunks:
a checkpoint saved on 4 ranks with FULL_SHARD loads on 2, or onto a 2-D HYBRID_SHARD mesh, or
NO_SHARD. Before reading, the checkpoint's keys, global shapes and dtypes are checked against the
live model (and optimizer), and every difference is reported at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from simplefsdp._compat import unwrap_compiled
from simplefsdp.checkpoint import sync, train_state
from simplefsdp.checkpoint.errors import CheckpointCorruptError, StateDictMismatchError
from simplefsdp.checkpoint.manifest import MANIFEST_NAME, fsync_directory, verify_manifest, write_manifest
from simplefsdp.checkpoint.optim_state import allocate_targets, flatten_optimizer, load_optimizer
from simplefsdp.checkpoint.safe_reader import SafeFileSystemReader, read_metadata
from simplefsdp.checkpoint.train_state import read_train_state, write_train_state
from simplefsdp.offload import refresh_device_copies

__all__ = ["LoadedCheckpoint", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"step_(\d{9,})(\.tmp)?")
_TMP = ".tmp"
MODEL_PREFIX = "model."
DEFAULT_TIMEOUT = sync.DEFAULT_TIMEOUT


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored. `skipped`: the newer checkpoints it passed over, with why."""

    path: Path
    step: int
    extra: dict[str, Any]
    saved_world_size: int
    skipped: tuple[str, ...] = ()


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def _step_of(path: Path) -> int | None:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match and not match.group(2) else None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoints under `directory` that are complete by name (final name + manifest), oldest first.

    Cheap (no hashing, not collective); `load_checkpoint` verifies the bytes.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _step_of(p) is not None and (p / MANIFEST_NAME).is_file()]
    return sorted(found, key=_step_of)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `directory` that is complete by name, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state by checkpoint key: the live tensors (DTensor shards), so DCP loads in place."""
    state = unwrap_compiled(model).state_dict()
    objects = [fqn for fqn, value in state.items() if not isinstance(value, torch.Tensor)]
    if objects:
        raise TypeError(f"model state entries {objects} are not tensors; simplefsdp checkpoints hold tensors only")
    return {f"{MODEL_PREFIX}{fqn}": value for fqn, value in state.items()}


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every call without a process group; one plain process is a supported use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _remove_checkpoint(path: Path) -> None:
    """Manifest first: a checkpoint half deleted by a crash never looks complete."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _prune(root: Path, *, keep_last: int | None, current: Path) -> None:
    for stale in root.iterdir():  # interrupted saves
        if _NAME.fullmatch(stale.name) and stale.name.endswith(_TMP):
            shutil.rmtree(stale, ignore_errors=True)
    if keep_last is None:
        return
    for old in list_checkpoints(root)[:-keep_last]:
        if old != current:
            logger.info("removing old checkpoint %s (keep_last=%d)", old, keep_last)
            _remove_checkpoint(old)


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = 3,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> Path:
    """Collective: write `directory/step_<step>/` atomically and return its path.

    Saves the model's sharded state dict and the optimizer's state (tensors, via DCP), the optimizer's
    hyperparameters, `step`, `extra` (JSON values, e.g. the data loader's position) and every rank's
    RNG states. Keeps the `keep_last` newest checkpoints (None: all). Every rank must call it with the
    same `step`; a rank that does not arrive within `timeout` makes the others raise `RankTimeoutError`.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(directory)
    sync.wait_for_all_ranks(what=f"save_checkpoint(step={step})", timeout=timeout)
    steps = sync.all_gather_objects(step)
    if len(set(steps)) > 1:
        raise ValueError(f"save_checkpoint called with different steps on different ranks: {steps} (by rank)")
    final, tmp = _step_dir(root, step), _step_dir(root, step).with_name(_step_dir(root, step).name + _TMP)
    if sync.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    sync.wait_for_all_ranks(what=f"save_checkpoint(step={step}): directory created", timeout=timeout)

    tensors = _model_tensors(model)
    optimizer_json = None
    if optimizer is not None:
        optim = flatten_optimizer(unwrap_compiled(model), optimizer)
        tensors.update(optim.tensors)
        optimizer_json = {"param_groups": optim.param_groups, "scalars": optim.scalars, "layouts": optim.layouts}
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    # a tensor every rank holds whole (a buffer) is written by rank 0, not by whichever rank DCP's
    # load balancing picks: per-rank state such as BatchNorm statistics is saved as rank 0 has it,
    # as the full export does (see [Note: BatchNorm in training mode] in simplefsdp/replicated.py)
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with _single_process_quietly():
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=not sync.is_distributed())
    write_train_state(tmp, step=step, extra=extra or {}, optimizer=optimizer_json)
    sync.wait_for_all_ranks(what=f"save_checkpoint(step={step}): data written", timeout=timeout)
    write_manifest(tmp, step=step)
    if sync.rank() == 0:
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_directory(root)
    sync.wait_for_all_ranks(what=f"save_checkpoint(step={step}): committed", timeout=timeout)
    if sync.rank() == 0:
        _prune(root, keep_last=keep_last, current=final)
    logger.info("saved checkpoint %s", final)
    return final


def _candidates(path: Path, *, fallback: bool) -> list[Path]:
    """Checkpoints to try, newest first: `path` itself if it is one (then older ones), else `path`'s."""
    if _step_of(path) is not None or (path / MANIFEST_NAME).exists():
        older = [p for p in list_checkpoints(path.parent) if _step_of(p) < (_step_of(path) or 0)]
        return [path, *reversed(older)] if fallback else [path]
    found = list(reversed(list_checkpoints(path)))
    return found if fallback else found[:1]


def _check_model(metadata: Metadata, tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mismatched) lines comparing the model's tensors with the checkpoint's."""
    missing, mismatched = [], []
    for key, tensor in tensors.items():
        entry = metadata.state_dict_metadata.get(key)
        live = f"{tuple(tensor.shape)} {tensor.dtype}"
        if entry is None:
            missing.append(f"{key}: model {live}")
        elif not isinstance(entry, TensorStorageMetadata):
            mismatched.append(f"{key}: checkpoint holds a non-tensor object, model {live}")
        elif tuple(entry.size) != tuple(tensor.shape) or entry.properties.dtype != tensor.dtype:
            mismatched.append(f"{key}: checkpoint {tuple(entry.size)} {entry.properties.dtype}, model {live}")
    unexpected = [
        f"{key}: checkpoint {tuple(getattr(entry, 'size', ()))}"
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and key not in tensors
    ]
    return missing, unexpected, mismatched


def _read_locally(candidate: Path) -> tuple[Metadata | None, dict | None, list[str]]:
    """This rank's reads of `candidate`'s DCP metadata and train state, and the problems it met."""
    try:
        return read_metadata(candidate), read_train_state(candidate), []
    except CheckpointCorruptError as err:
        return None, None, err.problems


def _first_good(candidates: list[Path]) -> tuple[Path, Metadata, dict, list[str]]:
    """Collective: the newest candidate that is good on every rank, its metadata and train state; what was skipped.

    Raises `CheckpointCorruptError` for the last candidate if none is good.

    [Note: every rank takes the same checkpoint]
    A candidate is good iff its bytes verify (`verify_manifest`, itself agreed) and every rank can
    read its metadata and train state; each rank reads them itself, as the load will, and the ranks
    merge their problems (`sync.agree_on_problems`) before anyone decides. So a file one rank alone
    cannot read makes all ranks skip the candidate, with the same reason, naming that rank; were the
    verdicts local, that rank would fall back alone and the ranks would load different checkpoints,
    or hang in collectives that no longer match. Checking on rank 0 alone and broadcasting would
    miss faults only another rank meets.
    """
    skipped = []
    for candidate in candidates:
        problems = verify_manifest(candidate)
        if not problems:
            metadata, document, local = _read_locally(candidate)
            problems = sync.agree_on_problems(local)
            if not problems:
                return candidate, metadata, document, skipped
        if candidate is candidates[-1]:
            raise CheckpointCorruptError(candidate, problems)
        logger.warning("checkpoint %s is not usable, falling back to an older one: %s", candidate, problems)
        skipped.append(f"{candidate}: {'; '.join(problems)}")
    raise AssertionError("unreachable: the last candidate returns or raises")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    fallback: bool = True,
    restore_rng: bool = True,
    missing_ok: bool = False,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> LoadedCheckpoint | None:
    """Collective: restore `model` (and `optimizer`) in place from a checkpoint; return what was loaded.

    `path` is a root directory (its newest checkpoint is taken) or one checkpoint. Its files are
    verified against the manifest first; a corrupt or incomplete one raises `CheckpointCorruptError`,
    or with `fallback=True` the next older one is tried (the skipped ones are in the result). The
    model may be sharded differently from when it was saved (other world size, strategy, mesh).
    Keys, shapes or dtypes that differ raise `StateDictMismatchError` listing them all (`strict=False`
    skips the missing and unexpected keys, not mismatched shapes). `restore_rng` sets this rank's
    generators to the saved ones (rank 0's if the checkpoint had fewer ranks). With `missing_ok`, a
    root holding no checkpoint returns None instead of raising `FileNotFoundError`.
    """
    path = Path(path)
    sync.wait_for_all_ranks(what=f"load_checkpoint({path})", timeout=timeout)
    candidates = sync.broadcast_object(_candidates(path, fallback=fallback))  # one listing for all ranks
    if not candidates:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no complete checkpoint (step_<N>/ with {MANIFEST_NAME}) under {path}")
    chosen, metadata, document, skipped = _first_good(candidates)

    model_tensors = _model_tensors(model)
    missing, unexpected, mismatched = _check_model(metadata, model_tensors)
    optim_tensors: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        if document["optimizer"] is None:
            missing.append("optimizer state: the checkpoint was saved without an optimizer")
        layouts = (document["optimizer"] or {}).get("layouts")
        optim_tensors, optim_unexpected = allocate_targets(
            unwrap_compiled(model), optimizer, metadata, layouts=layouts, source=chosen
        )
        unexpected += optim_unexpected
    if mismatched or (strict and (missing or unexpected)):
        raise StateDictMismatchError(chosen, missing=missing, unexpected=unexpected, mismatched=mismatched)
    present = {k: v for k, v in model_tensors.items() if k in metadata.state_dict_metadata}
    with _single_process_quietly():
        reader = SafeFileSystemReader(chosen)
        dcp.load({**present, **optim_tensors}, storage_reader=reader, no_dist=not sync.is_distributed())
    refresh_device_copies(unwrap_compiled(model))  # offloaded masters: the copies the device keeps
    if optimizer is not None and document["optimizer"] is not None:
        load_optimizer(
            unwrap_compiled(model),
            optimizer,
            tensors=optim_tensors,
            scalars=document["optimizer"]["scalars"],
            param_groups=document["optimizer"]["param_groups"],
            source=chosen,
        )
    if restore_rng:
        rng = document["rng"]
        if sync.rank() >= len(rng):
            logger.warning("checkpoint saved on %d ranks: rank %d takes rank 0's RNG states", len(rng), sync.rank())
        train_state.restore_rng(rng[sync.rank()] if sync.rank() < len(rng) else rng[0])
    sync.wait_for_all_ranks(what=f"load_checkpoint({chosen}): loaded", timeout=timeout)
    logger.info("loaded checkpoint %s (step %d)", chosen, document["step"])
    return LoadedCheckpoint(
        path=chosen,
        step=int(document["step"]),
        extra=dict(document["extra"]),
        saved_world_size=int(document["world_size"]),
        skipped=tuple(skipped),
    )
