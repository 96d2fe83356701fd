"""Checks that a command can write its output where it was told to, made before the work, not after.

    check_file(args.out, name="--out")              # a file written at the end
    check_directory(args.out, name="--out")         # a directory made (if need be) and filled at the end

A command that measures or trains for minutes and then fails to write its result loses the work: it
checks the destination first and stops with one line naming the setting. Nothing is created by a
check. Permissions are asked of the system (`os.access`), which also reports a read-only file system.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_directory", "check_file"]


def _nearest_existing(path: Path) -> Path:
    """`path`, or the closest of its ancestors that exists (the current directory for a relative path)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_file(path: str | os.PathLike, *, name: str) -> None:
    """ValueError naming `name` unless a file can be written at `path`: its directory exists and takes
    new files, and `path` is not a directory nor a file that cannot be written."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{name} {path}: is a directory, not a file")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{name} {path}: directory {parent} does not exist")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise ValueError(f"{name} {path}: not writable")


def check_directory(path: str | os.PathLike, *, name: str) -> None:
    """ValueError naming `name` unless `path` is a directory that takes new files, or can be made one
    (its nearest existing ancestor is a writable directory)."""
    existing = _nearest_existing(Path(path))
    if not existing.is_dir():
        raise ValueError(f"{name} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: {existing} is not writable")
