"""Checkpoints: sharded (DCP) save / load that survives crashes and resharding, full-state export / import.

    from simplefsdp import checkpoint

    checkpoint.save_checkpoint(root, step=step, model=model, optimizer=opt, extra={"data_offset": n})
    resumed = checkpoint.load_checkpoint(root, model=model, optimizer=opt, missing_ok=True)
    checkpoint.export_full_state_dict(model, "export/")   # safetensors, the unwrapped model's names
    checkpoint.import_full_state_dict(model, "export/")   # rank 0 reads, each rank gets its shards

See `sharded.py` for the layout and the atomic-write protocol, `safe_reader.py` for why loading never
runs pickled code.
"""

from simplefsdp.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    RankTimeoutError,
    StateDictMismatchError,
)
from simplefsdp.checkpoint.full_export import export_full_state_dict
from simplefsdp.checkpoint.full_import import import_full_state_dict
from simplefsdp.checkpoint.full_source import load_full_state_dict
from simplefsdp.checkpoint.sharded import (
    LoadedCheckpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "LoadedCheckpoint",
    "RankTimeoutError",
    "StateDictMismatchError",
    "export_full_state_dict",
    "import_full_state_dict",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
]
