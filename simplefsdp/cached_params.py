"""Modules that keep their own references to their parameters, outside `_parameters`.

[Note: parameters cached in module attributes]
Wrapping replaces each entry of `module._parameters` by a new `nn.Parameter` holding the shard and
makes `module.<name>` gather it (`parametrize.py`). A module that stored its parameters somewhere
else as well -- a list in an instance attribute, read by its forward -- would keep the original
full tensors alive (the memory sharding was meant to free) and compute with their stale values, the
gradient reaching no sharded parameter: training that runs and silently learns nothing there.

- `nn.RNNBase` (LSTM, GRU, RNN) is such a module: its forward passes `self._flat_weights` to the
  fused kernel, a list it refreshes only when `getattr` returns other objects than last time (and
  then calls `flatten_parameters()`, which on CUDA would copy the weights into one cuDNN buffer).
  Its wrapped class reads `_flat_weights` through a property that gathers every weight by name at
  each access (once per forward), refreshing and re-initialising the list are no-ops (nothing is
  cached; `.to()` and `to_empty()` would otherwise gather every weight) and
  `flatten_parameters()` is a no-op (a gathered weight lives for one step; there is nothing to
  flatten in place). The instance's own list is pointed at the sharded parameters, so nothing holds
  the originals and `sharded_parameters()` (which restores the user's class) sees the shards.
- Any other module found holding a parameter in an attribute (a tensor, or a list / tuple / dict
  of them, one level deep) gets one warning naming the module, the attribute and the fix (read
  `self.<name>` in forward, or assign the attribute after wrapping) -- never silence.

[Note: recurrent modules run eagerly]
Dynamo does not trace `nn.LSTM` / `nn.GRU` / `nn.RNN`: it breaks the graph at the call unless
`torch._dynamo.config.allow_rnn` is set, and with it set torch 2.13 fails to compile even an
unwrapped LSTM on the CPU (inductor and aot_eager both reject the `mkldnn_rnn_layer` op). Left to
itself, the graph break would make dynamo compile each weight's gather as a frame of its own,
specialised on the parameter's name, until it hits its recompile limit and falls back to eager
with a warning about recompiles. So a wrapped RNN's forward runs eagerly on purpose
(`torch.compiler.disable`): its weights are gathered once per call (DTensor collectives, one per
weight) and their gradients reduced the same way, outside the passes' buckets, and the rest of the
model compiles around it, once per input shape. `wrap()` says so in one warning naming the modules
(`warn_about_eager_modules`). A recurrence written with `nn.LSTMCell` / `nn.GRUCell` in a loop is
traced and compiled like any other module. On CUDA, cuDNN packs the gathered weights into its own
buffer at each call (torch warns that they are not one contiguous chunk): one more copy of the
layer's weights per call, not measured here (no GPU has been available).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from simplefsdp._compat import RNN_FLAT_WEIGHTS, RNN_REBUILD_METHODS, point_rnn_weights, rnn_weight_names
from simplefsdp.class_swap import user_class

__all__ = ["gathered_attributes", "repoint_caches", "warn_about_cached_references", "warn_about_eager_modules"]

logger = logging.getLogger(__name__)

_MODULE_OWN = {"_parameters", "_buffers", "_modules"}  # nn.Module's registries: not caches


_GATHERED = "_simplefsdp_gathered_flat_weights"  # this forward's gathered weights, while it runs


def _gathered_weights(self: nn.RNNBase) -> list[torch.Tensor | None]:
    return [getattr(self, name, None) for name in rnn_weight_names(self)]


def _flat_weights(self: nn.RNNBase) -> list[torch.Tensor | None]:
    gathered = self.__dict__.get(_GATHERED)
    if gathered is not None:
        return gathered
    return _gathered_weights(self)


def _set_flat_weights(self: nn.RNNBase, value: list) -> None:
    """`RNNBase` assigns the list it computed; the property computes its own, so there is nothing to keep."""


def _nothing_to_do(self: nn.Module) -> None:
    """Nothing cached, nothing to refresh or flatten (see [Note: parameters cached in module attributes])."""


def _eager_forward(cls: type[nn.RNNBase]):
    """`cls.forward` run eagerly, with every weight gathered once for the whole call (its input
    checks read `_flat_weights` too); see [Note: recurrent modules run eagerly]."""

    def forward(self: nn.RNNBase, *args, **kwargs):
        self.__dict__[_GATHERED] = _gathered_weights(self)
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            del self.__dict__[_GATHERED]  # autograd keeps what backward needs; the module keeps nothing

    return torch.compiler.disable(forward)


def gathered_attributes(cls: type[nn.Module]) -> dict[str, object]:
    """Class attributes a wrapped `cls` needs besides the parameters' own properties."""
    if not issubclass(cls, nn.RNNBase):
        return {}
    return {
        "forward": _eager_forward(cls),
        RNN_FLAT_WEIGHTS: property(_flat_weights, _set_flat_weights, doc="Each weight gathered, in kernel order."),
        # nothing to rebuild; `_apply` (`.to()`, `to_empty()`) calls one of them: no gather there
        **dict.fromkeys(RNN_REBUILD_METHODS, _nothing_to_do),
        "flatten_parameters": _nothing_to_do,
    }


def _tensors_in(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def warn_about_cached_references(model: nn.Module) -> list[str]:
    """Warn once about every module attribute of `model` that holds one of its parameters (see the
    note), except the ones wrapping handles itself (an `nn.RNNBase`'s `_flat_weights`); returns
    them as `"<module>.<attribute>"`. Call before the parameters are replaced."""
    params = {id(p) for p in model.parameters()}
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in _MODULE_OWN or (attr == RNN_FLAT_WEIGHTS and isinstance(module, nn.RNNBase)):
                continue
            if any(id(t) in params for t in _tensors_in(value)):
                found.append(f"{name or '<root>'}.{attr}")
    if not found:
        return found
    where = ", ".join(found)
    logger.warning(
        "simplefsdp.wrap: %s keeps references to its parameters in module attributes (%s); after "
        "wrapping those still hold the unsharded originals, so code that reads them computes with stale "
        "values and its gradients reach no sharded parameter. Read the parameters as `self.<name>` "
        "in forward, or rebuild those attributes from `self.<name>` after wrapping.",
        user_class(model).__name__,
        where,
    )
    return found


def repoint_caches(module: nn.Module) -> None:
    """After `module`'s parameters were replaced: an `nn.RNNBase`'s own `_flat_weights` list holds
    the new (sharded) parameters, not the originals."""
    if isinstance(module, nn.RNNBase):
        point_rnn_weights(module, [module._parameters.get(n) for n in rnn_weight_names(module)])


def warn_about_eager_modules(model: nn.Module) -> list[str]:
    """Warn once, naming them, about the modules of `model` that run eagerly inside a compiled
    model (see [Note: recurrent modules run eagerly]); returns their names."""
    eager = [
        f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules() if isinstance(m, nn.RNNBase)
    ]
    if eager:
        logger.warning(
            "simplefsdp.wrap: %s run eagerly inside torch.compile (Dynamo does not trace RNN, GRU or LSTM "
            "modules): their weights are gathered and reduced one collective each, outside the compiled "
            "buckets; the rest of %s compiles. Training is unaffected; to compile the recurrence, write "
            "it with nn.LSTMCell / nn.GRUCell in a loop.",
            ", ".join(eager),
            user_class(model).__name__,
        )
    return eager
