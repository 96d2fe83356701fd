"""Materialize a model built on the meta device and wrapped: each rank allocates only its shards.

    with torch.device("meta"):
        model = Transformer(args)           # no memory, no RNG consumed
    simplefsdp.wrap(model, mesh)            # sharded DTensor parameters, still on meta
    torch.manual_seed(seed)
    simplefsdp.materialize(model)           # == torch.manual_seed(seed); Transformer(args), sharded

[Note: exact single-process initialization, one parameter at a time]
Random init on a shard cannot reproduce the values a single process draws for the whole tensor
(the generator's stream is laid out over the full tensor). So `materialize` replays the model's
init code with every in-place op on a sharded parameter (`normal_`, `uniform_`, `fill_`, `mul_`,
...) redirected to a temporary full tensor of that parameter, created on first touch and run
through the same ops -- consuming the generator exactly as a single process does -- then sharded
into the parameter (this rank's part copied, no communication) as soon as the init moves on to
another parameter. At most one full parameter exists at a time; everything else is shards.

The default init replays what construction did: each module's own `reset_parameters()`, in
post-order (children before parents, siblings in registration order), which is the order
constructors run them. A parameter whose value is set in `__init__` without a
`reset_parameters()` (or the `init` you pass) keeps uninitialized memory: give its module one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from simplefsdp.class_swap import user_class
from simplefsdp.offload import move_offloaded_to_host
from simplefsdp.parametrize import sharded_parameters

__all__ = ["materialize"]


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def reset_in_construction_order(model: nn.Module) -> None:
    """Call every module's `reset_parameters()`, children before parents."""
    for module in _post_order(model):
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


# ops that overwrite every element (no need to read the current value first)
_WRITES_ALL = {
    "normal_", "uniform_", "fill_", "zero_", "zeros_", "ones_", "constant_", "copy_", "bernoulli_", "random_",
    "exponential_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_",
    "orthogonal_", "eye_", "dirac_", "sparse_",
}  # fmt: skip
_VIEWS = {"view", "view_as", "reshape", "t", "transpose", "flatten", "unflatten", "narrow", "__getitem__", "chunk"}


@dataclasses.dataclass
class _Replay(TorchFunctionMode):
    """Redirects in-place ops on sharded parameters to one full temporary tensor at a time."""

    params: dict[int, DTensor]
    buffers: set[int]  # ids of the buffers; those an in-place op wrote move to `written`
    written: set[int] = dataclasses.field(default_factory=set)
    current: DTensor | None = None
    full: torch.Tensor | None = None
    peak_full_bytes: int = 0

    def __post_init__(self) -> None:
        super().__init__()

    def flush(self) -> None:
        if self.current is not None:
            shard = distribute_tensor(self.full, self.current.device_mesh, self.current.placements, src_data_rank=None)
            with torch.no_grad():
                self.current.to_local().copy_(shard.to_local())
        self.current = self.full = None

    def _start(self, target: DTensor, name: str) -> None:
        self.flush()
        self.current = target
        with torch.no_grad():
            if name in _WRITES_ALL:
                self.full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            else:  # a read-modify-write init sees the current values
                self.full = target.full_tensor()
        self.peak_full_bytes = max(self.peak_full_bytes, self.full.numel() * self.full.element_size())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        # nn.init.* take the tensor as `tensor=` when they dispatch here; Tensor methods as args[0]
        in_kwargs = "tensor" in kwargs
        target = kwargs["tensor"] if in_kwargs else (args[0] if args else None)
        if id(target) in self.buffers and name.endswith("_"):
            self.written.add(id(target))
        if id(target) not in self.params:
            return func(*args, **kwargs)
        if name in _VIEWS:
            raise RuntimeError(
                f"materialize(): the init takes a view ({name}) of a sharded parameter of shape "
                f"{tuple(target.shape)}; only in-place ops on whole parameters are replayed"
            )
        if not name.endswith("_") or name.startswith("__"):
            return func(*args, **kwargs)  # a read (size(), dim(), ...): the DTensor answers globally
        if target is not self.current:
            self._start(target, name)
            self.written.add(id(target))
        if in_kwargs:
            kwargs["tensor"] = self.full
        else:
            args = (self.full, *args[1:])
        with torch.no_grad():
            func(*args, **kwargs)
        return target


def materialize(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> int:
    """Allocate `model`'s (meta) shards on `device` and initialize them as one process would.

    `device` defaults to the device type of the parameters' mesh. `init(model)` is the init to
    replay (default: every module's `reset_parameters()`, see the module note); inside it
    `module.weight` is the sharded parameter, and in-place ops on it act on the full value.
    Returns the most bytes one temporary full parameter took (the peak beyond the shards).
    """
    params = {fqn: p for fqn, p in model.named_parameters() if isinstance(p, DTensor)}
    if not params:
        raise ValueError(
            f"{user_class(model).__name__} has no sharded parameters: call simplefsdp.wrap() before materialize()"
        )
    real = [fqn for fqn, t in [*params.items(), *model.named_buffers()] if not _local(t).is_meta]
    real += [fqn for fqn, p in model.named_parameters() if fqn not in params and not p.is_meta]
    if real:
        raise ValueError(f"materialize() would overwrite tensors that are not on the meta device: {_names(real)}")
    if device is None:
        device = next(iter(params.values())).device_mesh.device_type
    model.to_empty(device=device)
    tensors = {fqn: t for fqn, t in [*model.named_parameters(), *model.named_buffers()]}
    replay = _Replay(
        params={id(p): p for p in model.parameters() if isinstance(p, DTensor)},
        buffers={id(b) for b in model.buffers()},
    )
    with sharded_parameters(model):
        with replay:
            (init or reset_in_construction_order)(model)
        replay.flush()
    move_offloaded_to_host(model)
    unset = [fqn for fqn, t in tensors.items() if id(t) not in replay.written]
    if unset:
        raise ValueError(
            f"the init left {_names(unset)} uninitialized (built on meta, never written): set them in "
            "their module's reset_parameters() or in the init= you pass"
        )
    return replay.peak_full_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _names(fqns: list[str]) -> str:
    shown = ", ".join(repr(f) for f in fqns[:8])
    return shown + (f" and {len(fqns) - 8} more" if len(fqns) > 8 else "")
