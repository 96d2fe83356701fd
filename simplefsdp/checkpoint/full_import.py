"""Import a full state dict into a wrapped model: rank 0 reads, every rank receives only its shards.

    with torch.device("meta"):
        model = Transformer(args)
    simplefsdp.wrap(model)
    simplefsdp.materialize(model)              # or model.to_empty(...) plus your buffers' init
    import_full_state_dict(model, "export/")   # collective

What FSDP1 calls `sync_module_states` and Accelerate `cpu_ram_efficient_loading`.

[Note: rank 0 reads, each rank receives its own chunk]
Only rank 0 opens the file (`full_source.py`: headers first, one tensor paged in at a time). Every
rank reports, once, where its local shard of each parameter sits in the global tensor (the DTensor's
`__create_chunk_list__`, the protocol DCP uses); rank 0 then walks the keys in `state_dict()` order,
reads one tensor, copies its own chunk, and `send`s each other rank exactly its chunk, which that
rank `recv`s straight into a buffer of its shard's size. So no rank but 0 ever holds more than its
shards plus one chunk, and rank 0 one full tensor at a time. The placement does not matter (Shard,
Replicate, 1-D or 2-D meshes: a replica receives the same chunk as its peer). Plain tensors (buffers,
integer parameters) are broadcast from rank 0. Shapes are checked before anything moves, and all
ranks raise the same `StateDictMismatchError`; dtypes are cast to the model's.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp._compat import unwrap_compiled
from simplefsdp.checkpoint import sync
from simplefsdp.checkpoint.errors import CheckpointError, StateDictMismatchError
from simplefsdp.checkpoint.full_source import FullStateSource
from simplefsdp.offload import refresh_device_copies

__all__ = ["import_full_state_dict"]

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes) of a rank's local shard


def _local_chunk(key: str, value: DTensor) -> Chunk:
    chunks = value.__create_chunk_list__()
    if len(chunks) != 1:
        raise NotImplementedError(f"{key}: a local shard in {len(chunks)} pieces is not supported")
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes)


def _region(full: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    offsets, sizes = chunk
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _check(source: FullStateSource, state: dict[str, torch.Tensor], *, strict: bool) -> StateDictMismatchError | None:
    names = set(source.names())
    missing = [f"{key}: model {tuple(v.shape)}" for key, v in state.items() if key not in names]
    unexpected = [f"{key}: file {source.shape(key)}" for key in source.names() if key not in state]
    mismatched = [
        f"{key}: file {source.shape(key)}, model {tuple(v.shape)}"
        for key, v in state.items()
        if key in names and source.shape(key) != tuple(v.shape)
    ]
    if mismatched or (strict and (missing or unexpected)):
        return StateDictMismatchError(source.path, missing=missing, unexpected=unexpected, mismatched=mismatched)
    return None


def _scatter(key: str, value: DTensor, full: torch.Tensor | None, chunks: list[dict[str, Chunk]]) -> None:
    """Rank 0 holds `full`; every rank ends with its chunk of it in `value`'s local shard."""
    local = value.to_local()
    if sync.rank() == 0:
        for dst in range(1, sync.world_size()):
            piece = _region(full, chunks[dst][key])
            if piece.numel():
                dist.send(piece.to(local.device, local.dtype).contiguous(), dst=dst)
        local.copy_(_region(full, chunks[0][key]))
    elif local.numel():
        received = torch.empty(local.shape, dtype=local.dtype, device=local.device)
        dist.recv(received, src=0)
        local.copy_(received)


def _broadcast(value: torch.Tensor, full: torch.Tensor | None) -> None:
    if sync.rank() == 0:
        value.copy_(full)
    if sync.is_distributed():
        buffer = value if value.is_contiguous() else value.contiguous()
        dist.broadcast(buffer, src=0)
        if buffer is not value:
            value.copy_(buffer)


def _raise_everywhere(error: Exception | None, path: object) -> None:
    """Collective: rank 0's `error` (or None) raised on every rank, as the same mismatch report."""
    summary = None
    if isinstance(error, StateDictMismatchError):
        summary = ("mismatch", error.missing, error.unexpected, error.mismatched)
    elif error is not None:
        summary = ("error", f"{type(error).__name__}: {error}")
    summary = sync.broadcast_object(summary)
    if error is not None:
        raise error
    if summary is not None and summary[0] == "mismatch":
        raise StateDictMismatchError(path, missing=summary[1], unexpected=summary[2], mismatched=summary[3])
    if summary is not None:
        raise CheckpointError(f"rank 0 could not read the full state dict at {path}: {summary[1]}")


@torch.no_grad()
def import_full_state_dict(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    timeout: timedelta = sync.DEFAULT_TIMEOUT,
) -> None:
    """Collective: load the full state dict at `path` (read on rank 0 only) into the wrapped `model`.

    `path`: a safetensors file or directory (as `export_full_state_dict` writes it) or a torch file
    of a flat state dict, loaded with `weights_only=True`. `strict=False` skips missing and
    unexpected keys; shape mismatches always raise `StateDictMismatchError`, on every rank.
    """
    state = unwrap_compiled(model).state_dict()
    sync.wait_for_all_ranks(what=f"import_full_state_dict({path})", timeout=timeout)
    source, error = None, None
    if sync.rank() == 0:
        try:
            source = FullStateSource(path)
            error = _check(source, state, strict=strict)
        except Exception as err:  # every rank must learn of it, or the others wait forever
            error = err
    _raise_everywhere(error, path)
    present = sync.broadcast_object(None if source is None else set(source.names()))
    keys = [key for key in state if key in present]
    chunks = sync.all_gather_objects({k: _local_chunk(k, state[k]) for k in keys if isinstance(state[k], DTensor)})
    for key in keys:
        value = state[key]
        full = source.get(key) if source is not None else None
        if isinstance(value, DTensor):
            _scatter(key, value, full, chunks)
        else:
            _broadcast(value, full)
        del full
    refresh_device_copies(unwrap_compiled(model))  # offloaded masters: the copies the device keeps
    sync.wait_for_all_ranks(what=f"import_full_state_dict({path}): loaded", timeout=timeout)
