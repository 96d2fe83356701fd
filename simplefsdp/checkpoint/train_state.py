"""The non-tensor part of a checkpoint, as JSON: step, user state (data position), optimizer
hyperparameters, and every rank's RNG states.

JSON and not pickle, so that loading runs no code from the checkpoint (see `safe_reader.py`). The
file is written by rank 0 inside the checkpoint directory before the manifest, so the manifest's
checksum covers it.

Invariant: `restore_rng(capture_rng())` leaves every generator (torch CPU, each initialised CUDA
device, Python's `random`, and NumPy's global generator if NumPy is imported) exactly where it was,
so training that draws random numbers after a resume draws the same ones as without the stop.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from simplefsdp.checkpoint import sync
from simplefsdp.checkpoint.errors import CheckpointCorruptError, StateDictMismatchError

__all__ = [
    "TRAIN_STATE_NAME",
    "capture_rng",
    "decode_param_groups",
    "read_train_state",
    "restore_rng",
    "write_train_state",
]

logger = logging.getLogger(__name__)

TRAIN_STATE_NAME = "train_state.json"


def _bytes_to_text(state: torch.Tensor) -> str:
    return base64.b64encode(bytes(state.tolist())).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This process's generator states, JSON-serialisable."""
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _bytes_to_text(torch.get_rng_state()), "python": [version, list(mt), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:  # only if the program uses NumPy: never import it for this
        name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state(legacy=True)
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put this process's generators back where `capture_rng()` found them."""
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_text_to_bytes(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            logger.warning(
                "CUDA RNG states saved for %d devices, %d visible: not restored", len(saved), torch.cuda.device_count()
            )
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _json_value(value: Any, where: str) -> Any:
    """`value` as plain JSON types (a 0-dim tensor as its number); a TypeError names `where` otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(
        f"{where} is a {type(value).__name__}; checkpoints store non-tensor state as JSON "
        "(None, bool, int, float, str, lists and str-keyed dicts of them)"
    )


def _like(saved: Any, current: Any) -> Any:
    """A JSON-decoded hyperparameter given the type the live optimizer uses for it."""
    if isinstance(current, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def decode_param_groups(saved: list[dict], current: list[dict], *, source: object) -> list[dict]:
    """Saved param groups (parameters by FQN) with values typed like `current`'s; errors list the FQNs."""
    if len(saved) != len(current):
        raise StateDictMismatchError(
            source,
            missing=[],
            unexpected=[],
            mismatched=[f"optimizer param_groups: {len(saved)} saved, the optimizer has {len(current)}"],
        )
    missing, unexpected = [], []
    for i, (old, new) in enumerate(zip(saved, current, strict=True)):
        missing += [f"optimizer param_groups[{i}]: {fqn}" for fqn in new["params"] if fqn not in old["params"]]
        unexpected += [f"optimizer param_groups[{i}]: {fqn}" for fqn in old["params"] if fqn not in new["params"]]
    if missing or unexpected:
        raise StateDictMismatchError(source, missing=missing, unexpected=unexpected, mismatched=[])
    return [
        {key: (value if key == "params" else _like(value, new.get(key))) for key, value in old.items()}
        for old, new in zip(saved, current, strict=True)
    ]


def write_train_state(
    directory: Path, *, step: int, extra: Mapping[str, Any], optimizer: Mapping[str, Any] | None
) -> None:
    """Collective: gather every rank's RNG states; rank 0 writes them with the rest to `directory`.

    `optimizer`: the optimizer's non-tensor state (`param_groups`, `scalars`), or None without one.
    """
    document = {
        "step": step,
        "world_size": sync.world_size(),
        "extra": _json_value(dict(extra), "extra"),
        "optimizer": None if optimizer is None else _json_value(dict(optimizer), "optimizer state"),
    }
    rng = sync.all_gather_objects(capture_rng())
    if sync.rank() != 0:
        return
    document["rng"] = rng
    with open(directory / TRAIN_STATE_NAME, "w") as f:
        json.dump(document, f)
        f.flush()
        os.fsync(f.fileno())


def read_train_state(directory: Path) -> dict[str, Any]:
    try:
        document = json.loads((directory / TRAIN_STATE_NAME).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointCorruptError(directory, [f"{TRAIN_STATE_NAME}: {err}"]) from err
    missing = {"step", "world_size", "extra", "optimizer", "rng"} - set(document)
    if missing:
        raise CheckpointCorruptError(directory, [f"{TRAIN_STATE_NAME}: lacks {sorted(missing)}"])
    return document
