"""Export a wrapped model's full state dict as safetensors, gathering one parameter at a time.

    export_full_state_dict(model, "export/")     # collective; rank 0 writes
    plain.load_state_dict(load_full_state_dict("export/"))   # any process, no simplefsdp needed

[Note: bounded memory]
The state is gathered key by key, in `state_dict()` order: `DTensor.full_tensor()` (an all-gather
over the parameter's mesh; a no-op for replicated ones) gives every rank the full parameter; rank 0
keeps a CPU copy, the others drop it at once. Rank 0 writes a safetensors file as soon as the kept
tensors reach `max_shard_bytes`, so its peak beyond its own shards is one file's worth plus one
parameter; every other rank's is one parameter. The file plan (which key goes to which file) is
computed up front from the global shapes, so files are named `model-0000i-of-0000N.safetensors`
with the Hugging Face index `model.safetensors.index.json`, or `model.safetensors` when one file
holds everything. Keys are the unwrapped model's names (`wrap()` keeps them); a tied parameter is
written under each of its names, as a plain `load_state_dict(strict=True)` expects.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp._compat import unwrap_compiled
from simplefsdp.checkpoint import sync
from simplefsdp.checkpoint.full_source import INDEX_NAME, SINGLE_FILE_NAME

__all__ = ["export_full_state_dict"]


def _plan_files(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into files of at most `max_shard_bytes` (a larger tensor gets a file of its own)."""
    files: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes.items():
        if files[-1] and used + nbytes > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(key)
        used += nbytes
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _gathered(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Collective over `value`'s mesh: the full value on CPU on rank 0, None elsewhere."""
    local = value.to_local() if isinstance(value, DTensor) else value
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if sync.rank() != 0:
        return None
    full = full.detach().to("cpu", dtype if dtype is not None and full.is_floating_point() else None).contiguous()
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()  # a replicated value is the model's own tensor: never write shared storage
    return full


def _write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, partial, metadata={"format": "pt"})
    os.replace(partial, path)


def export_full_state_dict(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = 2**30,
    dtype: torch.dtype | None = None,
    timeout: timedelta = sync.DEFAULT_TIMEOUT,
) -> Path:
    """Collective: write `model`'s full state dict under `directory` as safetensors (rank 0); return it.

    `dtype` casts floating-point tensors (e.g. `torch.bfloat16` for a release), None keeps them.
    Memory: see [Note: bounded memory] in this module. `timeout`: see `sync.wait_for_all_ranks`.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    state = unwrap_compiled(model).state_dict()
    objects = [key for key, value in state.items() if not isinstance(value, torch.Tensor)]
    if objects:
        raise TypeError(f"state entries {objects} are not tensors; safetensors holds tensors only")

    def nbytes(value: torch.Tensor) -> int:
        itemsize = dtype.itemsize if dtype is not None and value.is_floating_point() else value.element_size()
        return value.numel() * itemsize

    files = _plan_files({key: nbytes(value) for key, value in state.items()}, max_shard_bytes)
    names = _file_names(len(files))
    root = Path(directory)
    if sync.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    for keys, name in zip(files, names, strict=True):
        tensors = {key: _gathered(state[key], dtype) for key in keys}
        if sync.rank() == 0:
            _write(tensors, root / name)
        del tensors
    if sync.rank() == 0 and len(names) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes(v) for v in state.values())},
            "weight_map": {key: name for keys, name in zip(files, names, strict=True) for key in keys},
        }
        (root / INDEX_NAME).write_text(json.dumps(index, indent=1))
    sync.wait_for_all_ranks(what=f"export_full_state_dict({root})", timeout=timeout)
    return root
