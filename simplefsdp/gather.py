"""The one function that turns a sharded parameter into the full tensor a module computes with.

`gather_full(param, spec)` is called at every attribute access of a wrapped parameter (see
`parametrize.py`) and says, in order, what one access does:

1. a tied parameter already gathered in this forward of the wrapped root: reuse that value (`tied.py`);
2. gather over the data-parallel mesh (an offloaded shard: copied to the device first, `offload.py`;
   a tensor-parallel parameter: over dp only, then re-read as
   the TP DTensor its module expects, `tensor_parallel.py`) -- inside `no_sync`, from a detached
   shard, the gradient tapped into a sink instead of reduced; after it, with the deferred sum
   added to the gradient (`accumulate.py`, and the note below);
3. a tied parameter: keep the value for the rest of this forward.

Under torch.compile it is traced, so each gather becomes, in the graph:

    forward:  [cast to param_dtype] -> all_gather_into_tensor -> wait_tensor -> (unpad) -> compute
    backward: [cast to reduce_dtype] -> reduce_scatter_tensor / all_reduce -> wait_tensor -> [cast back]

[Note: grad_placements=Partial is what makes gradients right]
`DTensor.to_local()` has to be told what the gradient of the local tensor will look like. Each
rank's gradient of the full weight is only its own batch's contribution, i.e. a `Partial` value
over the data-parallel mesh. Without `grad_placements=Partial(...)` autograd would treat it as
`Replicate`, the backward would run no reduction at all, and every rank would silently step with
its local gradient. With it, the backward of the redistribution is the reduce-scatter (sharded
mesh dims) or all-reduce (replicated mesh dims) that data parallelism needs. The reduce op is
`avg` by default (what DDP and FSDP2 do) or `sum`.

[Note: resharding after forward]
By default the partitioner saves the all-gathered weight for backward, which is ZeRO-2. For
ZeRO-3 the gather is wrapped in a non-reentrant activation checkpoint when compiling: dynamo tags
every op inside it (cast, all-gather, wait, unpad) as recompute, so the min-cut partitioner saves
only the sharded parameter and re-gathers in backward exactly the weights backward uses. A plain
checkpoint is used rather than a selective policy: every op in the region is cheap and must be
recomputed, and a `context_fn` would print a warning on every compile. In eager mode the
checkpoint is skipped: the module's own autograd nodes save the full weight anyway, so eager
gives the same numbers with ZeRO-2 memory, and compile is where resharding happens.

[Note: the deferred sum meets the gradient in reduce_dtype]
A `no_sync` sum is kept in the reduction dtype and must join the gradient before the reduction
without passing through `param_dtype` (FSDP2 likewise accumulates in `reduce_dtype`). The cast to
`reduce_dtype` happens inside the gather's backward, after the gradient reached it in the dtype of
the gathered tensor -- and autograd casts a gradient to the dtype of the tensor it belongs to --
so a sum added to a bf16 gathered tensor's gradient would be rounded to bf16 first. The
synchronizing forward therefore gathers a parameter with a pending sum in the wider of
`param_dtype` and `reduce_dtype`, adds the sum to that tensor's gradient (`add_pending`), and casts
the tensor to `param_dtype` for the compute: the same values as a `param_dtype` gather (casting
commutes with the gather), and in backward the gradient is widened before the sum joins it. The
addition and the cast sit inside the checkpointed region, so resharding after forward still saves
only the shard -- except for a tensor-parallel parameter, whose sum joins at the TP level, after
the region (the partitioner may then save its compute-dtype copy in that step). Cost: with
`param_dtype` narrower than `reduce_dtype`, that forward's gathers of those parameters move
`reduce_dtype` bytes (once per optimizer step); otherwise nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.utils.checkpoint import checkpoint

from simplefsdp import accumulate, tied
from simplefsdp.accumulate import Accumulation
from simplefsdp.offload import HostShard, to_device
from simplefsdp.quantized_gather import QuantizedGather, gather_quantized, quantizes
from simplefsdp.tensor_parallel import TensorParallelLayout

__all__ = ["OWNER_KEY", "GatherSpec", "gather_full", "gather_jointly", "reduce_deferred"]

OWNER_KEY = "simplefsdp_param"  # node.meta["custom"] key naming the parameter a collective serves

ReduceOp = Literal["avg", "sum"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherSpec:
    """How one sharded parameter is gathered in forward and how its gradient is reduced in backward.

    Invariant: `len(full_placements) == len(grad_placements) == mesh.ndim`; every full placement is
    `Replicate()` and every grad placement is `Partial(reduce_op)`.
    """

    fqn: str  # the parameter's fully qualified name; tags its collectives in the graph (OWNER_KEY)
    mesh_ndim: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reduce_op: ReduceOp
    reshard_after_forward: bool
    # held by several modules: gathered once per root forward under this key, unique across
    # wrapped models (see `tied.py`); None for a parameter with one holder
    tied_key: str | None = None
    accumulation: Accumulation | None = dataclasses.field(default=None, compare=False)  # `no_sync` state
    # a tensor-parallel parameter: gathered over the dp mesh into the TP DTensor its module computes
    # with (see `tensor_parallel.py`); None for a plain parameter
    tp: TensorParallelLayout | None = dataclasses.field(default=None, compare=False)
    # an offloaded parameter: its shard lives in host memory and is copied to the device per gather
    # (see `offload.py`); None for a shard on the device
    host: HostShard | None = None
    # the copy of the shard the device keeps under `OffloadPolicy(parameters=False)`, read instead
    # of copying the host shard in
    device_copy: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    # gathered as block-scaled codes (`quantized_gather.py`); None: gathered in `param_dtype`
    quantized: QuantizedGather | None = None

    @property
    def full_placements(self) -> tuple[Placement, ...]:
        return (Replicate(),) * self.mesh_ndim

    @property
    def grad_placements(self) -> tuple[Placement, ...]:
        return (Partial(self.reduce_op),) * self.mesh_ndim


def gather_full(param: DTensor, spec: GatherSpec) -> torch.Tensor:
    """The full (unsharded) local tensor of `param`, in `spec.param_dtype`, differentiable; for a
    tensor-parallel parameter, the DTensor on the tp mesh with its TP placement, gathered over dp only.

    Its gradient is reduced over the mesh in `spec.reduce_dtype` and lands in `param.grad` as a
    DTensor with `param`'s placements and dtype (see the module docstring for the steps).
    """
    if spec.tied_key is not None and (earlier := tied.gathered(spec.tied_key)) is not None:
        return earlier
    state = _accumulation(param, spec)
    if state is not None and state.deferring:
        full = accumulate.tap(_gather(param.detach(), spec), state.sinks[spec.fqn])
    else:
        pending = state.use_pending(spec.fqn) if state is not None else None
        full = _gather(param, spec, pending)
    if spec.tied_key is not None:
        tied.remember(spec.tied_key, full)
    return full


def gather_jointly(pairs: Sequence[tuple[DTensor, GatherSpec]]) -> tuple[torch.Tensor, ...] | None:
    """Each `(param, spec)` gathered as `gather_full` would, resharded after forward under one
    checkpoint for all of them instead of one per parameter; None (gather each with `gather_full`)
    unless compiling, every spec reshards, and none needs per-parameter state: a tied parameter, a
    tensor-parallel one, or a `no_sync` sum to defer or add.

    [Note: one resharding checkpoint per block]
    Under torch.compile every checkpointed region is a higher-order op that Dynamo traces as a
    subgraph of its own, at a fixed cost per region (about 0.07 s on the CPU, paid by every
    parameter of every block: most of Dynamo's time in a deep model). A block compiled as a nested
    region (`regions.py`) gathers its parameters together, so one checkpoint around all of them
    tags the same ops for recomputation -- the backward re-gathers exactly what it did per
    parameter -- at one region's cost."""
    if not torch.compiler.is_compiling() or not all(_joinable(param, spec) for param, spec in pairs):
        return None
    return checkpoint(_gather_all, tuple(pairs), use_reentrant=False)


def _joinable(param: DTensor, spec: GatherSpec) -> bool:
    if not spec.reshard_after_forward or spec.tied_key is not None or spec.tp is not None:
        return False
    state = _accumulation(param, spec)
    return state is None or (not state.deferring and spec.fqn not in state.pending)


def _gather_all(pairs: tuple[tuple[DTensor, GatherSpec], ...]) -> tuple[torch.Tensor, ...]:
    return tuple(_tagged_redistribute(param, spec, None) for param, spec in pairs)


def reduce_deferred(param: DTensor, spec: GatherSpec, pending: torch.Tensor) -> None:
    """Reduce the deferred sum `pending` (this rank's unreduced full gradient, in `spec.reduce_dtype`)
    into `param.grad`, for a parameter the synchronizing forward did not use: zeros back-propagated
    through a gather that adds the sum, so the reduction is the one a used parameter's backward runs
    (same collective, dtype, placements and reduce op). All ranks call it together."""
    full = _gather(param, spec, pending)
    full.backward(torch.zeros_like(full))


def _accumulation(param: DTensor, spec: GatherSpec) -> Accumulation | None:
    """The model's `no_sync` state when a backward will run through this gather; None otherwise
    (then pending gradients wait for a gather that a backward runs through)."""
    if spec.accumulation is None or not param.requires_grad or not torch.is_grad_enabled():
        return None
    return spec.accumulation


def _gather(param: DTensor, spec: GatherSpec, pending: torch.Tensor | None = None) -> torch.Tensor:
    """`param` gathered; with a deferred sum `pending`, added to the gradient as [Note: the deferred
    sum meets the gradient in reduce_dtype] says."""
    if spec.tp is None:
        return _gather_dp(param, spec, pending)
    if pending is not None:  # at the TP level, where a TP-replicated parameter's gradient is still partial over tp
        return _adding(lambda wide: _gather(param, wide), param, spec, pending)
    return spec.tp.as_tensor_parallel(_gather_dp(spec.tp.dp_view(param), spec))


def _adding(
    gather: Callable[[GatherSpec], torch.Tensor], param: DTensor, spec: GatherSpec, pending: torch.Tensor
) -> torch.Tensor:
    """`gather(wide_spec)` -- gathering in the wider of the compute and the reduction dtype -- with
    `pending` added to its gradient, cast to the compute dtype."""
    compute = spec.param_dtype or param.dtype
    wide = torch.promote_types(compute, spec.reduce_dtype or param.dtype)
    return accumulate.add_pending(gather(dataclasses.replace(spec, param_dtype=wide)), pending).to(compute)


def _gather_dp(param: DTensor, spec: GatherSpec, pending: torch.Tensor | None = None) -> torch.Tensor:
    """`param` (a DTensor on the dp mesh) gathered over it: the full local tensor (with `pending`, see
    [Note: the deferred sum meets the gradient in reduce_dtype])."""
    if not torch.compiler.is_compiling():
        return _redistribute(param, spec, pending)
    if spec.reshard_after_forward:
        return checkpoint(_tagged_redistribute, param, spec, pending, use_reentrant=False)
    return _tagged_redistribute(param, spec, pending)


def _tagged_redistribute(param: DTensor, spec: GatherSpec, pending: torch.Tensor | None) -> torch.Tensor:
    # Every node traced here -- the cast, the all-gather and its wait, and in backward the
    # reduction -- carries node.meta["custom"][OWNER_KEY] = spec.fqn, so graph passes know which
    # parameter (and so which block) a collective belongs to.
    with fx_traceback.annotate({OWNER_KEY: spec.fqn}):
        return _redistribute(param, spec, pending)


def _redistribute(param: DTensor, spec: GatherSpec, pending: torch.Tensor | None) -> torch.Tensor:
    if pending is not None:
        return _adding(lambda wide: _redistribute(param, wide, None), param, spec, pending)
    if spec.host is not None:
        param = to_device(param, spec.host, spec.device_copy)
    if spec.quantized is not None and torch.compiler.is_compiling() and quantizes(param):
        return gather_quantized(
            param,
            spec.quantized,
            param_dtype=spec.param_dtype or param.dtype,
            reduce_dtype=spec.reduce_dtype or param.dtype,
            reduce_op=spec.reduce_op,
        )
    full = param.redistribute(
        placements=spec.full_placements,
        forward_dtype=spec.param_dtype,
        backward_dtype=spec.reduce_dtype,
    )
    return full.to_local(grad_placements=spec.grad_placements)
