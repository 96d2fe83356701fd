"""The `simplefsdp train` run an advice names, as something to paste: flags, a TOML file, a torchrun line.

    settings = run_settings(choice, shape=shape, param_dtype="bf16", ..., world_size=64)
    train_command(settings)        # simplefsdp train --shape llama3-8b --strategy ... --nproc 64
    torchrun_command(settings, world_size=64)   # torchrun --nnodes 8 --nproc-per-node 8 ... -m simplefsdp.train ...
    write_toml(settings, "advised.toml")        # the same settings as `simplefsdp train --config` reads them

`settings` maps `TrainConfig` field names to values: the model (`shape`, and any size in which the
advised shape differs from the named one), every setting the advisor chose (`Choice.train_settings`)
and the run's shape of work (dtypes, micro-batch, sequence, profile, shard group, world size as
`nproc`). Invariant: `parse_args` of the flags, or of `--config` with the TOML file, gives a
`TrainConfig` whose every key in `settings` holds the advised value (tested).
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from simplefsdp.inspect.choice import Choice
from simplefsdp.inspect.shapes import ModelShape, model_shape

__all__ = ["GPUS_PER_NODE", "run_settings", "toml_text", "torchrun_command", "train_command", "write_toml"]

GPUS_PER_NODE = 8  # the torchrun line's ranks per node: an 8-GPU node, the common H100 / H200 / A100 server
_SIZES = ("dim", "n_layers", "n_heads", "ffn_dim")  # what `simplefsdp train --shape` lets a run override


def run_settings(
    choice: Choice,
    *,
    shape: ModelShape,
    param_dtype: str,
    reduce_dtype: str,
    batch: int,
    seq: int,
    profile: str,
    shard_size: int | None,
    world_size: int,
) -> dict[str, Any]:
    """The `TrainConfig` settings of the advised run of `shape` (a named shape, possibly resized)."""
    named = model_shape(shape.name)  # ValueError for a shape train cannot name
    settings: dict[str, Any] = {"shape": shape.name}
    for size in _SIZES:
        if getattr(shape.args, size) != getattr(named.args, size):
            settings[size] = getattr(shape.args, size)
    settings |= choice.train_settings()
    settings |= {
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        "batch_per_rank": batch,
        "seq_len": seq,
        "profile": profile,
    }
    if choice.strategy.is_hybrid and shard_size is not None:
        settings["shard_size"] = shard_size
    settings["nproc"] = world_size
    return settings


def _flags(settings: dict[str, Any], *, skip: tuple[str, ...] = ()) -> str:
    flags = []
    for key, value in settings.items():
        if key in skip:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(flags)


def train_command(settings: dict[str, Any]) -> str:
    """`simplefsdp train` with `settings` as flags: spawns `nproc` ranks on this machine."""
    return f"simplefsdp train {_flags(settings)}"


def torchrun_command(settings: dict[str, Any] | None, *, world_size: int, config: str | None = None) -> str:
    """The torchrun line that starts `world_size` ranks, `GPUS_PER_NODE` per node (run it on each
    node; `$HEAD_NODE` is the first one's address), with `settings` as flags or a `--config` file."""
    per_node = math.gcd(world_size, GPUS_PER_NODE)
    nodes = world_size // per_node
    where = "--standalone" if nodes == 1 else "--rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500"
    args = f"--config {shlex.quote(config)}" if config is not None else _flags(settings or {}, skip=("nproc",))
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node} {where} -m simplefsdp.train {args}"


def toml_text(settings: dict[str, Any]) -> str:
    """`settings` as the flat TOML file `simplefsdp train --config` reads."""
    lines = ["# simplefsdp train --config FILE: the run `simplefsdp inspect --advise` advised"]
    for key, value in settings.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)  # a TOML basic string: the same quoting and escapes
        else:
            text = repr(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_toml(settings: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(toml_text(settings))
    return path
