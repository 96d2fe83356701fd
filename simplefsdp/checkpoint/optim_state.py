"""Optimizer state keyed by parameter name, in and out of a checkpoint.

`torch.optim.Optimizer.state_dict()` keys state by position (0, 1, ...), which changes when the
model or the param groups change and means nothing to another program. Here every entry is keyed
`optim.<parameter FQN>.<state name>` (e.g. `optim.layers.0.attention.wq.weight.exp_avg`): tensors
go to DCP (a DTensor state stays sharded like its parameter, so it reshards like the model), plain
Python values and the param groups' hyperparameters go to JSON.

[Note: why not `torch.distributed.checkpoint.state_dict.get_state_dict`]
That helper fills an empty optimizer's state by running `optimizer.step()` with zero gradients
and lr 0, so that DCP has tensors to load into. The step counters it leaves behind are harmless
when a load follows, but saving before the first step would bump Adam's counter and change the
rest of training. Here the load targets are allocated from the checkpoint's own metadata instead
(laid out as the entry was saved, see the next note), then handed to the public
`Optimizer.load_state_dict`, which also casts and moves them as the optimizer requires.

[Note: state layouts]
DCP's metadata says each entry's global shape and dtype, not whether it was a DTensor nor where
it lived, and shape alone cannot tell: a 0-dim parameter's `exp_avg` (a DTensor) and Adam's `step`
(a plain CPU tensor) are both 0-dim. So the save records each tensor entry's layout in
`train_state.json`, and the load allocates it so:
- "parameter": a DTensor laid out like its parameter (the same shape, mesh and placements), as
  every torch optimizer keeps its per-element state. It comes back laid out like the live
  parameter, so it reshards with the model. A DTensor entry laid out otherwise is refused at save;
- "cpu": a plain tensor on the CPU (Adam's `step` unless `capturable` or `fused`);
- "device": a plain tensor elsewhere, which comes back on its parameter's device.
A checkpoint saved before layouts were recorded has none: its entries are laid out by the rule
used then ("parameter" for a DTensor parameter's entry of the parameter's shape, else "device").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from simplefsdp.checkpoint.errors import CheckpointCorruptError
from simplefsdp.checkpoint.train_state import TRAIN_STATE_NAME, decode_param_groups
from simplefsdp.class_swap import user_class

__all__ = ["LAYOUTS", "OptimizerState", "allocate_targets", "flatten_optimizer", "load_optimizer"]

PREFIX = "optim."
LAYOUTS = ("parameter", "cpu", "device")  # see [Note: state layouts]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """An optimizer's state by FQN: `tensors` and their `layouts` by checkpoint key,
    `scalars[fqn][name]` (JSON values), `param_groups` with `params` as FQN lists."""

    tensors: dict[str, torch.Tensor]
    layouts: dict[str, str]
    scalars: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]]


def _optimizer_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of each optimizer parameter, in `state_dict()` index order (a tied one by its first name)."""
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise ValueError(
            f"optimizer parameters at indices {unknown} are not parameters of {user_class(model).__name__} "
            "(build the optimizer from model.parameters() after simplefsdp.wrap())"
        )
    return [names[id(p)] for p in params]


def _describe(tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"a DTensor {tuple(tensor.shape)} with placements {tensor.placements}"
    return f"a plain tensor {tuple(tensor.shape)}"


def _layout(*, key: str, value: torch.Tensor, param: torch.Tensor) -> str:
    """`value`'s entry in `LAYOUTS`; a ValueError naming `key` for a DTensor laid out unlike `param`."""
    if not isinstance(value, DTensor):
        return "cpu" if value.device.type == "cpu" else "device"
    layout = (value.shape, value.device_mesh, value.placements)
    if not isinstance(param, DTensor) or layout != (param.shape, param.device_mesh, param.placements):
        raise ValueError(
            f"optimizer state {key} is {_describe(value)}, its parameter {_describe(param)}: simplefsdp "
            "checkpoints DTensor optimizer state laid out like its parameter only"
        )
    return "parameter"


def flatten_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerState:
    fqns = _optimizer_fqns(model, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, str] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in saved["state"].items():
        for name, value in per_param.items():
            key = f"{PREFIX}{fqns[index]}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value
                layouts[key] = _layout(key=key, value=value, param=params[index])
            else:
                scalars.setdefault(fqns[index], {})[name] = value
    return OptimizerState(
        tensors=tensors, layouts=layouts, scalars=scalars, param_groups=_groups_by_fqn(saved["param_groups"], fqns)
    )


def _groups_by_fqn(groups: list[dict[str, Any]], fqns: list[str]) -> list[dict[str, Any]]:
    return [{**group, "params": [fqns[i] for i in group["params"]]} for group in groups]


def _target(*, entry: TensorStorageMetadata, param: torch.Tensor, layout: str) -> torch.Tensor:
    """An empty tensor to load `entry` into, laid out as `layout` says (see [Note: state layouts])."""
    if layout == "parameter":
        return torch.empty_like(param.detach(), dtype=entry.properties.dtype)
    device = "cpu" if layout == "cpu" else (param.to_local() if isinstance(param, DTensor) else param).device
    return torch.empty(entry.size, dtype=entry.properties.dtype, device=device)


def _layout_before_recording(*, entry: TensorStorageMetadata, param: torch.Tensor) -> str:
    """The layout a checkpoint without recorded layouts was loaded with."""
    return "parameter" if isinstance(param, DTensor) and tuple(entry.size) == tuple(param.shape) else "device"


def allocate_targets(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    *,
    layouts: dict[str, str] | None,
    source: object,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Empty tensors to load the checkpoint's optimizer entries into, laid out as `layouts` says
    (None: a checkpoint saved before layouts were recorded), and the entries of parameters this
    optimizer does not hold (as error lines). An entry without a known layout is corrupt."""
    params = dict(
        zip(_optimizer_fqns(model, optimizer), [p for g in optimizer.param_groups for p in g["params"]], strict=True)
    )
    targets, unexpected = {}, []
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(PREFIX):
            continue
        fqn = key[len(PREFIX) :].rsplit(".", 1)[0]
        if fqn not in params or not isinstance(entry, TensorStorageMetadata):
            unexpected.append(f"{key}: checkpoint {tuple(getattr(entry, 'size', ()))}")
            continue
        param = params[fqn]
        layout = _layout_before_recording(entry=entry, param=param) if layouts is None else layouts.get(key)
        if layout not in LAYOUTS:
            raise CheckpointCorruptError(source, [f"{TRAIN_STATE_NAME}: optimizer state {key} has layout {layout!r}"])
        targets[key] = _target(entry=entry, param=param, layout=layout)
    return targets, unexpected


def load_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tensors: dict[str, torch.Tensor],
    scalars: dict[str, dict[str, Any]],
    param_groups: list[dict[str, Any]],
    source: object,
) -> None:
    """Give `optimizer` the loaded state through `Optimizer.load_state_dict` (parameters matched by FQN)."""
    fqns = _optimizer_fqns(model, optimizer)
    index = {fqn: i for i, fqn in enumerate(fqns)}
    live_groups = _groups_by_fqn(optimizer.state_dict()["param_groups"], fqns)
    groups = decode_param_groups(param_groups, live_groups, source=source)
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, name = key[len(PREFIX) :].rsplit(".", 1)
        state.setdefault(index[fqn], {})[name] = value
    for fqn, values in scalars.items():
        state.setdefault(index[fqn], {}).update(values)
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in groups]}
    )
