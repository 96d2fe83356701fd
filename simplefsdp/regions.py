"""Compile a repeated block's body once, however many blocks the model stacks.

    simplefsdp.wrap(model, mesh)        # regions on by default: each repeated block is one
    model = torch.compile(model)        # nested compile region, traced and generated once

[Note: nested compile regions keep the collectives outside]
Compiling a whole model traces, partitions and generates code for every block again, although
the blocks are identical: the first step's compile grows linearly with depth. torch's
`nested_compile_region` lets Dynamo trace a marked function once and stamp the same subgraph out at
every later call (`invoke_subgraph`); AOTAutograd then traces and partitions it once, and inductor
lowers and generates it once. Marking the block itself would pull its parameters' all-gathers
into the subgraph, where the passes cannot bucket or prefetch them across blocks. So each
repeated block (`Region[<class>]`) splits its forward in two while compiling:

- outside, in the graph the passes see: every sharded parameter of the block read once (the
  property gathers it: cast, all-gather, wait, and in backward the reduce-scatter);
- inside the region: the block's own forward, run by `torch.func.functional_call` with those
  gathered tensors in place of the sharded parameters (the property returns a substituted plain
  tensor as it is, `parametrize.py`).

Forward: gathers -> invoke_subgraph(body); backward: invoke_subgraph(body's backward) -> the
gradients of the gathered tensors -> reductions. Eager calls run the forward as it was. Step time
and memory are those of the whole-graph compile (bench/results/measurements.md, "regions: step
time and memory unchanged").

[Note: what decides that two blocks share one region]
Dynamo's automatic reuse refuses a subgraph with side effects, and `functional_call` swaps the
parameters in and out of the modules (a side effect), so every call would be traced again. The
region therefore names its reuse key itself (`reuse_hash_fn`), and Dynamo trusts that key in
place of its guards: two calls with the same key run one traced subgraph. The key must cover
everything the block's trace depends on besides the gathered tensors:

- the block's structure and state: each submodule's class, its parameter and buffer names, its
  `training` flag, and every other attribute -- ints, floats, strings, bools, None, enums and
  tuples of them by value, anything else by identity (a config object all blocks share keeps them
  sharing; one object per block separates them: never wrong, only slower). `refresh_keys` computes
  it again, eagerly, before each compiled call of the wrapped root, so a changed attribute (a
  block switched to eval, a dropout probability set) changes the key, which Dynamo guards;
- the call: each tensor argument's shape, stride, dtype, device and `requires_grad`, every other
  argument's value (a call passing anything else -- a cache object, say -- skips the region and
  runs the block as it is), and whether grad mode is on.

Tensors a block keeps as plain attributes are captured by Dynamo per block, as any input.

[Note: the schema check of an invoke_subgraph is computed once]
With autograd on, torch checks on each `invoke_subgraph` call that its subgraph mutates no input,
by generating the operator's schema -- which re-traces the subgraph (about 0.1 s per call on the
CPU, paid by every block in each traced pass over the graph). The result depends only on the
subgraph and its operands' metadata, so while a wrapped model compiles it is memoized per
(subgraph, operand metadata) (`_compat.region_compiles`).
"""

from __future__ import annotations

import enum
import functools
import hashlib

import torch
from torch import nn
from torch.func import functional_call

from simplefsdp._compat import nested_compile_region
from simplefsdp.class_swap import subclass, user_class
from simplefsdp.gather import gather_jointly

__all__ = ["has_regions", "install_regions", "refresh_keys"]

_KEY_ATTR = "_simplefsdp_region_key"
_MEMBERS_ATTR = "_simplefsdp_region_members"
_ORIGINAL_ATTR = "_simplefsdp_unregioned_class"
_ROOT_ATTR = "_simplefsdp_regions"  # on the wrapped root: its region blocks, in module order
_SPECS_ATTR = "_simplefsdp_gather_specs"  # parametrize.py's per-module specs (names of sharded parameters)
_PLAIN = (int, float, str, bool, type(None), enum.Enum, torch.dtype, torch.device)


def install_regions(root: nn.Module, blocks: list[str]) -> None:
    """Make each of `blocks` (FQNs under `root`, e.g. from `find_repeated_blocks`) a nested compile
    region while `root` compiles. Left as it is: a block without sharded parameters; one with
    tensor-parallel ones (their gathered values are DTensors, which a region body does not take:
    torch 2.13 fails the body's first op mixing them with plain tensors); one holding buffers (a
    region body may not write its inputs in training, and a batch norm's running statistics are
    written by its forward)."""
    regions = []
    for fqn in blocks:
        block = root.get_submodule(fqn)
        members = tuple(
            (f"{name}.{param}" if name else param, name, param)
            for name, module in block.named_modules()
            for param in sorted(getattr(module, _SPECS_ATTR, {}))
        )
        if not members or any(_tensor_parallel(block, name, param) for _, name, param in members):
            continue
        if next(block.buffers(), None) is not None:
            continue
        object.__setattr__(block, _MEMBERS_ATTR, members)
        block.__class__ = _region_class(type(block))
        regions.append(block)
    object.__setattr__(root, _ROOT_ATTR, tuple(regions))
    refresh_keys(root)


def _tensor_parallel(block: nn.Module, name: str, param: str) -> bool:
    return getattr(block.get_submodule(name), _SPECS_ATTR)[param].tp is not None


def has_regions(root: nn.Module) -> bool:
    """Whether `root` has blocks compiled as nested regions."""
    return bool(getattr(root, _ROOT_ATTR, ()))


@torch.compiler.disable
def refresh_keys(root: nn.Module) -> None:
    """Compute each region block's key from its current state ([Note: what decides that two blocks
    share one region]); run eagerly before each compiled call of `root`.

    The key is a digest of the state's `repr`, an object kept by identity standing for the order in
    which the walk first met it: the same model built the same way gets the same keys in every
    process (Dynamo guards the keys, and a guard saved by one process may be checked by another)."""
    seen: dict[int, int] = {}
    for block in getattr(root, _ROOT_ATTR, ()):
        object.__setattr__(block, _KEY_ATTR, _state_key(block, seen))


def _state_key(block: nn.Module, seen: dict[int, int]) -> int:
    parts = []
    for name, module in block.named_modules():
        attrs = tuple(
            (key, _value_key(value, seen))
            for key, value in sorted(vars(module).items())
            if key not in ("_parameters", "_buffers", "_modules")
            and not key.startswith("_simplefsdp")  # simplefsdp's own state: read outside the region
            and not isinstance(value, torch.Tensor)
        )
        params = tuple(sorted(module._parameters))
        buffers = tuple(sorted(module._buffers))
        parts.append((name, user_class(module).__qualname__, module.training, params, buffers, attrs))
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _value_key(value: object, seen: dict[int, int]) -> object:
    """What of an attribute's value the key holds: plain values, and containers of them, by value;
    a dict by its string keys and values (hook dicts are keyed by handle numbers, which differ
    between blocks); anything else -- a function, a config object -- by identity."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_value_key(v, seen) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", *sorted(repr(_value_key(v, seen)) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k if isinstance(k, str) else None, _value_key(v, seen)) for k, v in value.items()))
    return ("object", seen.setdefault(id(value), len(seen)))


def _substituted(block: nn.Module) -> bool:
    """Whether `functional_call` has put the gathered tensors in place of the block's sharded
    parameters (a gathered tensor is no `nn.Parameter`; under tensor parallelism it is a DTensor too)."""
    _, name, param = getattr(block, _MEMBERS_ATTR)[0]
    return not isinstance(block.get_submodule(name)._parameters[param], nn.Parameter)


def _flatten(args: tuple, kwargs: dict) -> list | None:
    """The call's arguments as one flat list: a header of constants saying how to rebuild them
    (`_unflatten`), then the leaves. Each argument must be a leaf (a tensor or a `_PLAIN` value) or a
    tuple of leaves; None otherwise.

    Flat positional values are what lets Dynamo match a region's later calls without flattening
    them through pytree (about 0.1 s a call); the header is ints and strings for the same reason."""
    leaves, widths = [], []
    for value in (*args, *kwargs.values()):
        if isinstance(value, tuple) and all(isinstance(v, (torch.Tensor, *_PLAIN)) for v in value):
            leaves.extend(value)
            widths.append(len(value))
        elif isinstance(value, (torch.Tensor, *_PLAIN)):
            leaves.append(value)
            widths.append(-1)
        else:
            return None
    return [len(args), len(kwargs), *kwargs, *widths, *leaves]


def _unflatten(flat: tuple) -> tuple[tuple, dict]:
    n_args, n_kwargs = flat[0], flat[1]
    names = flat[2 : 2 + n_kwargs]
    widths = flat[2 + n_kwargs : 2 + n_kwargs + n_args + n_kwargs]
    at, values = 2 + 2 * n_kwargs + n_args, []
    for width in widths:
        if width < 0:
            values.append(flat[at])
            at += 1
        else:
            values.append(tuple(flat[at : at + width]))
            at += width
    return tuple(values[:n_args]), dict(zip(names, values[n_args:], strict=True))


def _reuse_key(block: nn.Module, *flat) -> int:
    key = hash((getattr(block, _KEY_ATTR), torch.is_grad_enabled()))
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            key = hash((key, tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device.type, leaf.requires_grad))
        else:
            key = hash((key, leaf))
    return key


def _body(block: nn.Module, *flat):
    """The block's forward on `flat` = (*gathered parameters in member order, *`_flatten`ed call)."""
    members = getattr(block, _MEMBERS_ATTR)
    params = {fqn: value for (fqn, _, _), value in zip(members, flat[: len(members)], strict=False)}
    args, kwargs = _unflatten(flat[len(members) :])
    return functional_call(block, params, args, kwargs, tie_weights=False, strict=False)


_region = nested_compile_region(_body, reuse_key=_reuse_key)


def _gathered(block: nn.Module) -> tuple[torch.Tensor, ...]:
    """The block's sharded parameters gathered, in member order: together under one resharding
    checkpoint where `gather_jointly` can, else each through its module's property."""
    modules = [(block.get_submodule(name), param) for _, name, param in getattr(block, _MEMBERS_ATTR)]
    pairs = [(module._parameters[param], getattr(module, _SPECS_ATTR)[param]) for module, param in modules]
    joint = gather_jointly(pairs)
    return joint if joint is not None else tuple(getattr(module, param) for module, param in modules)


@functools.cache
def _region_class(cls: type[nn.Module]) -> type[nn.Module]:
    original = cls.forward

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling() or _substituted(self):
            return original(self, *args, **kwargs)
        flat = _flatten(args, kwargs)
        if flat is None:  # an argument the region cannot key (a cache object): the block as it is
            return original(self, *args, **kwargs)
        return _region(self, *_gathered(self), *flat)

    forward.__doc__ = original.__doc__
    return subclass(cls, adds="Region", attrs={"forward": forward, _ORIGINAL_ATTR: cls, "__module__": cls.__module__})
