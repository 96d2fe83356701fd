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
(a state entry shaped like its parameter gets the parameter's mesh and placements; any other
shape, like Adam's `step`, is a plain replicated tensor), then handed to the public
`Optimizer.load_state_dict`, which also casts and moves them as the optimizer requires.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from simplefsdp.checkpoint.train_state import decode_param_groups
from simplefsdp.class_swap import user_class

__all__ = ["OptimizerState", "allocate_targets", "flatten_optimizer", "load_optimizer"]

PREFIX = "optim."


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """An optimizer's state by FQN: `tensors` by checkpoint key, `scalars[fqn][name]` (JSON values),
    `param_groups` with `params` as FQN lists."""

    tensors: dict[str, torch.Tensor]
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


def flatten_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerState:
    fqns = _optimizer_fqns(model, optimizer)
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in saved["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{PREFIX}{fqns[index]}.{name}"] = value
            else:
                scalars.setdefault(fqns[index], {})[name] = value
    return OptimizerState(tensors=tensors, scalars=scalars, param_groups=_groups_by_fqn(saved["param_groups"], fqns))


def _groups_by_fqn(groups: list[dict[str, Any]], fqns: list[str]) -> list[dict[str, Any]]:
    return [{**group, "params": [fqns[i] for i in group["params"]]} for group in groups]


def allocate_targets(
    model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Empty tensors to load the checkpoint's optimizer entries into, and the entries of parameters
    this optimizer does not hold (as error lines)."""
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
        if isinstance(param, DTensor) and tuple(entry.size) == tuple(param.shape):
            targets[key] = torch.empty_like(param.detach(), dtype=entry.properties.dtype)
        else:
            device = param.to_local().device if isinstance(param, DTensor) else param.device
            targets[key] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
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
