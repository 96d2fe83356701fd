"""The manifest that makes a checkpoint directory complete: every file's size and SHA-256.

[Note: what "complete" means]
A checkpoint directory is complete iff its name is final (`step_<N>`, no `.tmp` suffix), it holds
`manifest.json`, and every file the manifest lists exists with the listed size and SHA-256. The
manifest is written last, after every rank's data is on disk (fsynced), and the directory gets its
final name only after that (see `sharded.py`). So a crash at any point leaves either a `.tmp`
directory, which no reader considers, or a complete checkpoint; and a file truncated or altered
later (a full disk, a bad copy, bit rot) fails verification instead of loading garbage.

Hashing is spread over the ranks (file i goes to rank i mod world), so writing and verifying a
checkpoint reads each byte once in total, not once per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from simplefsdp.checkpoint import sync
from simplefsdp.checkpoint.errors import CheckpointError

__all__ = ["MANIFEST_NAME", "fsync_directory", "verify_manifest", "write_manifest"]

MANIFEST_NAME = "manifest.json"
_FORMAT = "simplefsdp-checkpoint"
_VERSION = 1
_CHUNK_BYTES = 8 * 2**20


def _digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def fsync_directory(path: Path) -> None:
    """Make the directory's entries (created, renamed files) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _my_share(names: list[str]) -> list[str]:
    return names[sync.rank() :: sync.world_size()]


def _listing(directory: Path) -> list[str]:
    """Collective: the union of every rank's listing of `directory` (manifest aside), sorted.

    [Note: one listing for all ranks]
    The names decide which rank hashes which file, so every rank must hash from the same list. A
    rank always sees the files it wrote itself, but maybe not yet those another node wrote (an NFS
    directory cache), so neither its own listing nor rank 0's alone is safe: the union of all of
    them holds every file any rank wrote, and it is the same on every rank. A file a rank does not
    list is still opened by name, which a shared filesystem resolves afresh.
    """
    mine = [p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_NAME]
    return sorted({name for part in sync.all_gather_objects(mine) for name in part})


def _hash_my_share(directory: Path, names: list[str]) -> tuple[dict[str, tuple[int, str]], list[str]]:
    """(size, SHA-256) of this rank's share of `names`, and one problem line per file it could not read."""
    digests, problems = {}, []
    for name in _my_share(names):
        try:
            digests[name] = _digest(directory / name)
        except OSError as err:
            problems.append(f"{name}: unreadable ({err})")
    return digests, problems


def write_manifest(directory: Path, *, step: int) -> None:
    """Collective: hash every file of `directory` (each rank its share); rank 0 writes the manifest.

    Call it once every rank's files are written and fsynced; on return the manifest is durable.
    The manifest lists every file any rank sees (`_listing`); if a rank cannot read its share,
    every rank raises `CheckpointError` naming the files and ranks, and no manifest is written.
    """
    names = _listing(directory)
    digests, problems = _hash_my_share(directory, names)
    problems = sync.agree_on_problems(problems)
    if problems:
        raise CheckpointError(f"cannot write the manifest of {directory}:\n  " + "\n  ".join(problems))
    merged: dict[str, tuple[int, str]] = {}
    for part in sync.all_gather_objects(digests):
        merged.update(part)
    if sync.rank() != 0:
        return
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "files": {name: {"bytes": merged[name][0], "sha256": merged[name][1]} for name in names},
    }
    partial = directory / (MANIFEST_NAME + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, directory / MANIFEST_NAME)
    fsync_directory(directory)


def _read_manifest(directory: Path) -> tuple[dict | None, str | None]:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return None, f"{MANIFEST_NAME}: missing (the save did not finish)"
    except (OSError, ValueError) as err:
        return None, f"{MANIFEST_NAME}: unreadable ({err})"
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _FORMAT
        or not isinstance(manifest.get("files"), dict)
        or not all(_is_entry(entry) for entry in manifest["files"].values())
    ):
        return None, f"{MANIFEST_NAME}: not a {_FORMAT} manifest"
    if manifest.get("version") != _VERSION:
        return None, f"{MANIFEST_NAME}: version {manifest.get('version')!r}, this simplefsdp reads {_VERSION}"
    return manifest, None


def _is_entry(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)


def _check_files(directory: Path, files: dict) -> list[str]:
    problems = []
    for name in _my_share(sorted(files)):
        expected = files[name]
        path = directory / name
        try:
            if not path.is_file():
                problems.append(f"{name}: missing")
            elif (size := path.stat().st_size) != expected["bytes"]:
                problems.append(f"{name}: {size} bytes, the manifest says {expected['bytes']} (truncated?)")
            elif _digest(path)[1] != expected["sha256"]:
                problems.append(f"{name}: SHA-256 differs from the manifest (corrupted)")
        except OSError as err:
            problems.append(f"{name}: unreadable ({err})")
    return problems


def verify_manifest(directory: Path) -> list[str]:
    """Collective: the problems found (one line per file), the same list on every rank; [] if complete.

    No rank raises for a file it cannot read: that is a problem line too (naming the rank), so
    every rank reaches the same verdict, and the same next collective.
    """
    manifest, problem = _read_manifest(directory)
    problems = [problem] if manifest is None else _check_files(directory, manifest["files"])
    return sync.agree_on_problems(problems)
