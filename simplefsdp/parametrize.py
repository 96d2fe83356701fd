"""Attribute-access parametrization: `module.weight` returns the gathered full tensor.

[Note: why a class swap and not torch.nn.utils.parametrize]
`torch.nn.utils.parametrize.register_parametrization` moves the parameter to
`module.parametrizations.weight.original`, which renames every key of `named_parameters()` and
`state_dict()` and breaks optimizers' and checkpoints' expectations. Instead each module that owns
floating-point parameters gets a per-(class, names) subclass, `GatherOnAccess[<class>]` (see
[Note: class swaps] in `class_swap.py`),
whose class-level properties shadow those names. A property is a data descriptor, so
`module.weight` resolves to it before `nn.Module.__getattr__` would look in `_parameters`. The
parameter itself stays registered in `module._parameters["weight"]` under its original name, holding
the sharded DTensor, so `named_parameters()`, `state_dict()` and optimizers see exactly the sharded
masters.

Invariants:
- a swapped class subclasses the original, so `isinstance(module, nn.Linear)` still holds;
- the original class is recorded on the swapped one (`_simplefsdp_unsharded_class`), which is how
  `sharded_parameters()` and the double-wrap check recognise a wrapped module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.cached_params import gathered_attributes
from simplefsdp.class_swap import subclass, user_class
from simplefsdp.gather import GatherSpec, gather_full

__all__ = ["gather_on_access", "gather_specs", "gather_specs_by_parameter", "is_wrapped_module", "sharded_parameters"]

_SPECS_ATTR = "_simplefsdp_gather_specs"
_ORIGINAL_CLASS_ATTR = "_simplefsdp_unsharded_class"


def _gathered_property(name: str) -> property:
    def get(self: nn.Module):
        param = self._parameters[name]
        if not isinstance(param, nn.Parameter):  # the gathered value, put in by a region (`regions.py`)
            return param
        if not isinstance(param, DTensor):
            owner = user_class(self).__name__
            raise TypeError(
                f"parameter {name!r} of {owner} was replaced after simplefsdp.wrap() by a "
                f"{type(param).__name__}; assign an nn.Parameter holding a DTensor with the same "
                "placements, or assign before wrapping"
            )
        return gather_full(param, getattr(self, _SPECS_ATTR)[name])

    return property(get, doc=f"The full (all-gathered) value of the sharded parameter {name!r}.")


@functools.cache
def _sharded_class(cls: type[nn.Module], names: tuple[str, ...]) -> type[nn.Module]:
    attrs = {**gathered_attributes(cls), **{name: _gathered_property(name) for name in names}}
    attrs[_ORIGINAL_CLASS_ATTR] = cls
    attrs["__module__"] = __name__
    return subclass(cls, adds="GatherOnAccess", attrs=attrs)


def is_wrapped_module(module: nn.Module) -> bool:
    return hasattr(type(module), _ORIGINAL_CLASS_ATTR)


def gather_on_access(module: nn.Module, specs: dict[str, GatherSpec]) -> None:
    """Make each `module.<name>` in `specs` return the gathered full tensor of its sharded parameter."""
    setattr(module, _SPECS_ATTR, dict(specs))
    module.__class__ = _sharded_class(type(module), tuple(sorted(specs)))


def gather_specs(model: nn.Module) -> list[GatherSpec]:
    """The gather specs of every sharded parameter `model` holds (a tied one once per holder), in
    module order; empty for a model `wrap()` did not shard."""
    return [spec for module in model.modules() for spec in getattr(module, _SPECS_ATTR, {}).values()]


def gather_specs_by_parameter(model: nn.Module) -> list[tuple[nn.Parameter, GatherSpec]]:
    """Each sharded parameter of `model` once (a tied one with its first holder's spec), with its spec."""
    seen: dict[int, tuple[nn.Parameter, GatherSpec]] = {}
    for module in model.modules():
        for name, spec in getattr(module, _SPECS_ATTR, {}).items():
            param = module._parameters[name]
            seen.setdefault(id(param), (param, spec))
    return list(seen.values())


@contextlib.contextmanager
def sharded_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, `module.weight` is the raw sharded `nn.Parameter` (a DTensor), not the gathered tensor.

    For initialization (`nn.init.*_` and `reset_parameters()` act on the shards) and inspection.
    Nothing is gathered inside the block. The classes are restored on exit, also on error.
    """
    swapped = {m: type(m) for m in model.modules() if is_wrapped_module(m)}
    if not swapped:
        raise ValueError(
            f"{user_class(model).__name__} is not wrapped by simplefsdp.wrap(): it has no sharded parameters"
        )
    for module, cls in swapped.items():
        module.__class__ = getattr(cls, _ORIGINAL_CLASS_ATTR)
    try:
        yield model
    finally:
        for module, cls in swapped.items():  # the exact class each had (the root's also runs the passes)
            module.__class__ = cls
