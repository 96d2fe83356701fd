"""Reading a full (unsharded) state dict from disk one tensor at a time, without running pickled code.

Accepted layouts, the ones `export_full_state_dict` writes and the Hugging Face convention:
- a directory with `model.safetensors`, or with `model.safetensors.index.json` and its shard files;
- a single `.safetensors` file;
- a torch file (`torch.save` of a flat dict of tensors), opened with `weights_only=True` (torch's
  restricted unpickler) and `mmap=True`, so tensors are paged in as they are read.
Nothing is read until `get(key)`; keys and shapes come from the headers.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from safetensors import safe_open

from simplefsdp.checkpoint.errors import CheckpointCorruptError, CheckpointError

__all__ = ["INDEX_NAME", "SINGLE_FILE_NAME", "FullStateSource", "load_full_state_dict"]

SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class FullStateSource:
    """Lazy access to the tensors of a full state dict at `path` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._files: dict[str, object] = {}  # file name -> open safe_open handle
        self._torch: dict[str, torch.Tensor] | None = None
        self._where: dict[str, str] = {}  # key -> safetensors file name
        if self.path.is_dir() and (self.path / INDEX_NAME).is_file():
            try:
                self._where = dict(json.loads((self.path / INDEX_NAME).read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointCorruptError(self.path, [f"{INDEX_NAME}: {err!r}"]) from err
        elif self.path.is_dir() and (self.path / SINGLE_FILE_NAME).is_file():
            self._index_file(SINGLE_FILE_NAME)
        elif self.path.is_file() and self.path.suffix == ".safetensors":
            self.path, name = self.path.parent, self.path.name
            self._index_file(name)
        elif self.path.is_file():
            self._torch = self._load_torch_file()
        else:
            raise FileNotFoundError(
                f"no full state dict at {self.path}: expected a .safetensors file, a torch file, or a directory "
                f"holding {SINGLE_FILE_NAME} or {INDEX_NAME}"
            )

    def _open(self, name: str):
        if name not in self._files:
            try:
                self._files[name] = safe_open(self.path / name, framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types for bad headers
                raise CheckpointCorruptError(self.path / name, [f"not a readable safetensors file: {err}"]) from err
        return self._files[name]

    def _index_file(self, name: str) -> None:
        self._where.update(dict.fromkeys(self._open(name).keys(), name))

    def _load_torch_file(self) -> dict[str, torch.Tensor]:
        try:
            loaded = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{self.path}: refused by torch.load(weights_only=True): {err}") from err
        except (RuntimeError, EOFError, OSError) as err:
            raise CheckpointCorruptError(self.path, [f"not a readable torch file: {err}"]) from err
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            found = type(loaded).__name__ if not isinstance(loaded, dict) else "a dict with non-tensor values"
            raise CheckpointError(f"{self.path} holds {found}; expected a flat dict of tensors (a state dict)")
        return loaded

    def names(self) -> list[str]:
        return list(self._torch) if self._torch is not None else list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._torch is not None:
            return tuple(self._torch[key].shape)
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        if self._torch is not None:
            return self._torch[key]
        return self._open(self._where[key]).get_tensor(key)


def load_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole state dict at `path` in memory, for a plain (unwrapped) model's `load_state_dict`."""
    source = FullStateSource(path)
    return {key: source.get(key) for key in source.names()}
