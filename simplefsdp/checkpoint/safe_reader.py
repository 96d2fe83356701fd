"""A DCP `FileSystemReader` that never runs pickled code from a checkpoint.

[Note: what DCP unpickles, and what we do about it]
Reading a DCP checkpoint with torch's own `FileSystemReader` touches pickle in three places (torch
2.13, `torch/distributed/checkpoint/filesystem.py` and `default_planner.py`):
1. tensors: `torch.load(..., weights_only=True)`, torch's restricted unpickler: safe;
2. the `.metadata` file: plain `pickle.load`, which can run any code the file names;
3. non-tensor values (`BYTE_IO` items, e.g. an int or a dict in the state dict): `torch.load(...,
   weights_only=False)` in the default load planner: also arbitrary code.
`SafeFileSystemReader` closes 2 with an allow-list unpickler: `.metadata` may only name DCP's own
metadata dataclasses, `torch.Size`, torch dtypes / layouts / memory formats and paths (the list,
which names torch internals, is `_compat.DCP_METADATA_GLOBALS`); anything
else fails with the name it asked for. It closes 3 by refusing any `BYTE_IO` item: simplefsdp
saves tensors only (step, RNG states and the data position go to JSON, see `train_state.py`), so
a checkpoint that asks us to unpickle an object was not written by us. The manifest's checksums
are verified before either is read, which catches corruption but not a forged checkpoint: the
allow-list is what makes a forged one harmless.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from simplefsdp._compat import DCP_METADATA_GLOBALS
from simplefsdp.checkpoint.errors import CheckpointCorruptError, CheckpointError

__all__ = ["METADATA_NAME", "SafeFileSystemReader", "read_metadata"]

METADATA_NAME = ".metadata"  # DCP's metadata file name (torch 2.11-2.13)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{METADATA_NAME} refers to {module}.{name}, which is not DCP checkpoint metadata; refusing to load it"
        )


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of the checkpoint in `directory`, unpickled with the allow-list above."""
    path = directory / METADATA_NAME
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointCorruptError(directory, [f"{METADATA_NAME}: missing"]) from None
    except OSError as err:
        raise CheckpointCorruptError(directory, [f"{METADATA_NAME}: unreadable ({err})"]) from err
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointCorruptError(directory, [f"{METADATA_NAME}: {err}"]) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(directory, [f"{METADATA_NAME}: holds a {type(metadata).__name__}, not Metadata"])
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` with the allow-list metadata unpickler and no unpickling of non-tensor items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported by simplefsdp's reader")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        pickled = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled:
            raise CheckpointError(
                f"checkpoint {self.path} stores {pickled} as pickled objects; simplefsdp loads tensors only "
                "and never unpickles objects from a checkpoint"
            )
        return super().read_data(plan, planner)
