"""`wrap()`: turn a plain `nn.Module` into a simplefsdp model, in place."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from simplefsdp import gloo
from simplefsdp._compat import regions_supported
from simplefsdp.accumulate import Accumulation, attach
from simplefsdp.blocks import find_repeated_blocks, validate_patterns
from simplefsdp.cached_params import repoint_caches, warn_about_cached_references, warn_about_eager_modules
from simplefsdp.class_swap import user_class
from simplefsdp.gather import GatherSpec, ReduceOp, reduce_deferred
from simplefsdp.mesh import resolve_mesh
from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.offload import (
    HostShard,
    OffloadPolicy,
    attach_device_copy,
    device_copy_of,
    host_device_of,
    on_host,
    refresh_after_load,
)
from simplefsdp.offload_plan import OffloadPlan
from simplefsdp.parametrize import gather_on_access, is_wrapped_module
from simplefsdp.passes.fsdp_pass import FsdpPass, PassConfig
from simplefsdp.passes.install import attach_pass
from simplefsdp.quantized_gather import QuantizedGather
from simplefsdp.regions import install_regions
from simplefsdp.replicated import broadcast_replicated
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.tensor_parallel import TensorParallelLayout, check_tensor_parallel, shard_tensor_parallel
from simplefsdp.tied import install_scope

__all__ = ["is_wrapped_root", "make_pass", "wrap"]

logger = logging.getLogger(__name__)

_ROOT_ATTR = "_simplefsdp_wrapped"  # set on the module wrap() was called on
_WRAP_IDS = itertools.count()


def wrap(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    reduce_op: ReduceOp = "avg",
    passes: PassConfig | None = PassConfig(),
    offload: OffloadPolicy | OffloadPlan | None = None,
    compile_regions: bool = True,
) -> nn.Module:
    """Shard `model`'s floating-point parameters over `mesh`, in place, and return `model`.

    Args:
        model: a plain module (its parameters plain tensors on one device type), or one already
            parallelized with torch's `parallelize_module` (tensor parallel: DTensor parameters).
        mesh: the data-parallel mesh; `None` is 1-D over the default process group. The
            `HYBRID_*` strategies need a 2-D mesh `(replicate, shard)`. For a tensor-parallel
            model, the data-parallel submesh of the mesh the tp mesh was sliced from (its dims
            before the tp dims): each parameter then becomes a DTensor on `(*dp dims, *tp dims)`,
            gathered over dp only (`tensor_parallel.py`).
        strategy: a `ShardingStrategy` or its name (see `strategy.py` for the table).
        mp_policy: mixed precision; `None` computes and reduces in the parameters' own dtype.
        reshard_after_forward: overrides the strategy's default (True for FULL_SHARD / HYBRID_SHARD).
        reduce_op: `"avg"` (default, what DDP and FSDP2 do) or `"sum"` over the data-parallel ranks.
        passes: what `torch.compile(model)` does to the collectives (bucketing, reordering; see
            `simplefsdp.passes`); the default buckets per repeated block, `None` turns the passes off.
        offload: what lives in host memory (`offload.py`): `OffloadPolicy()` keeps the sharded
            masters, their gradients and the optimizer state there; an `OffloadPlan` a tier per
            block (`offload_plan.py`); `None` keeps all on the device.
        compile_regions: compile each repeated block's body once as a nested compile region
            (`regions.py`): the first step's compile then barely grows with depth; the gathers
            and reductions stay in the graph the passes see.

    After the call, for every floating-point parameter: `named_parameters()` and `state_dict()`
    yield it under its original name as an `nn.Parameter` holding a DTensor with the strategy's
    placements; `module.<name>` returns the full tensor (gathered in `param_dtype`), and its
    gradient lands reduced in `param.grad` with the master's placements and dtype. Buffers and
    non-floating-point parameters stay whole on every rank and take rank 0's values, as the
    sharded parameters do (`replicated.py`). A tied parameter (one
    object in several modules) stays one sharded parameter, gathered once per forward of `model`
    and reduced once (`tied.py`); a frozen one (`requires_grad=False`) is gathered and never reduced.

    Steps: every check first (an error leaves the model as it was), then each parameter is sharded
    and its module made to gather it on access, then the root gets what acts on the whole model
    (input casts, the tied-parameter scope, `no_sync` state, the compiler pass).
    """
    strategy, mp_policy = _check_arguments(
        model,
        strategy=strategy,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        reduce_op=reduce_op,
        passes=passes,
        offload=offload,
    )
    params = _floating_params(model)
    mesh = _check_model(model, params, mesh, strategy, passes=passes, offload=offload)
    reshard = strategy.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    settings = _Settings(
        mesh=mesh,
        strategy=strategy,
        mp_policy=mp_policy,
        reduce_op=reduce_op,
        reshard_after_forward=reshard,
        accumulation=Accumulation(),
        wrap_id=next(_WRAP_IDS),
        offload=offload,
        host_device=host_device_of(mesh.device_type),
    )
    warn_about_cached_references(model)
    warn_about_eager_modules(model)
    for group in mesh.get_all_groups():
        gloo.warn_if_racy(group)
    has_tied = _shard_parameters(model, params, settings)
    _log_upcast_masters(model, params)
    broadcast_replicated(model, mesh)
    _install_on_root(model, settings, passes=passes, has_tied=has_tied)
    if compile_regions:
        _install_regions(model, passes)
    logger.info(
        "simplefsdp.wrap: %d parameters (%.2fM elements) -> %s on %s, reshard_after_forward=%s, %s",
        len(params),
        sum(p.numel() for p in params.values()) / 1e6,
        strategy.value,
        mesh,
        reshard,
        mp_policy,
    )
    return model


def _log_upcast_masters(model: nn.Module, originals: dict[str, nn.Parameter]) -> None:
    """Say once what [Note: full-precision masters] cost: how many parameters came in narrower than
    their master, and the bytes per rank that added."""
    upcast = {fqn: p for fqn, p in model.named_parameters() if fqn in originals and p.dtype != originals[fqn].dtype}
    if not upcast:
        return
    added = sum(p.to_local().numel() * (p.dtype.itemsize - originals[fqn].dtype.itemsize) for fqn, p in upcast.items())
    dtypes = sorted({str(originals[fqn].dtype).removeprefix("torch.") for fqn in upcast})
    logger.warning(
        "simplefsdp.wrap: %d %s parameters get fp32 sharded masters under the mixed-precision policy "
        "(+%.1f MiB per rank); wrap without mp_policy to train in %s throughout",
        len(upcast),
        "/".join(dtypes),
        added / 2**20,
        "/".join(dtypes),
    )


def is_wrapped_root(model: nn.Module) -> bool:
    """Whether `model` is a module `wrap()` was called on."""
    return bool(getattr(model, _ROOT_ATTR, False))


def _check_arguments(
    model: nn.Module,
    *,
    strategy: ShardingStrategy | str,
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool | None,
    reduce_op: str,
    passes: PassConfig | None,
    offload: OffloadPolicy | OffloadPlan | None,
) -> tuple[ShardingStrategy, MixedPrecisionPolicy]:
    """The arguments' types and values; returns the strategy and the mixed-precision policy (the
    default one for None)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"simplefsdp.wrap() takes an nn.Module, got {type(model).__name__}")
    strategy = ShardingStrategy.parse(strategy)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True, False or None (the strategy's default), got {reshard_after_forward!r}"
        )
    if reduce_op not in ("avg", "sum"):
        raise ValueError(f"reduce_op must be 'avg' or 'sum', got {reduce_op!r}")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a simplefsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if passes is not None and not isinstance(passes, PassConfig):
        raise TypeError(f"passes must be a simplefsdp.PassConfig or None, got {type(passes).__name__}")
    if offload is not None and not isinstance(offload, (OffloadPolicy, OffloadPlan)):
        raise TypeError(
            f"offload must be a simplefsdp.OffloadPolicy, an OffloadPlan or None, got {type(offload).__name__}"
        )
    return strategy, mp_policy


def _host_shard(offload: OffloadPolicy | None, device: torch.device) -> HostShard | None:
    """How gathers reach shards offloaded under `offload` (copied to `device`); None without offload."""
    if offload is None:
        return None
    return HostShard(device=device, pin_memory=offload.pin_memory, keep_device_copy=not offload.parameters)


def _check_model(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    mesh: DeviceMesh | None,
    strategy: ShardingStrategy,
    *,
    passes: PassConfig | None,
    offload: OffloadPolicy | OffloadPlan | None,
) -> DeviceMesh:
    """Everything about the model, the mesh, the bucket patterns and an offload plan's blocks that
    could fail, before anything changes; returns the mesh."""
    _check_wrappable(model, params, mesh)
    if passes is not None and passes.bucket is not None and passes.bucket.plan == "patterns":
        validate_patterns(passes.bucket.patterns, model)
    if isinstance(offload, OffloadPlan):
        offload.check_units(model)
    mesh = resolve_mesh(mesh, strategy=strategy, device_type=_device_type(params))
    _check_devices(params, mesh)
    for fqn, param in params.items():
        if isinstance(param, DTensor):
            check_tensor_parallel(param, dp_mesh=mesh, fqn=fqn)
    return mesh


def _floating_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Floating-point parameters by fully qualified name, each shared (tied) parameter once."""
    return {fqn: p for fqn, p in model.named_parameters() if p.is_floating_point()}


def _check_wrappable(model: nn.Module, params: dict[str, nn.Parameter], mesh: DeviceMesh | None) -> None:
    if getattr(model, _ROOT_ATTR, False):
        raise ValueError("the model is already wrapped by simplefsdp.wrap(); wrap a model once, at its root")
    for fqn, module in model.named_modules():
        if getattr(module, _ROOT_ATTR, False) or is_wrapped_module(module):
            where = f"submodule {fqn!r}" if fqn else "the model"
            raise ValueError(f"{where} is already wrapped by simplefsdp.wrap(); wrap a model once, at its root")
    tensor_parallel = [fqn for fqn, param in params.items() if isinstance(param, DTensor)]
    if tensor_parallel and mesh is None:
        param = params[tensor_parallel[0]]
        raise ValueError(
            f"parameter {tensor_parallel[0]!r} is already a DTensor ({param.placements} on {param.device_mesh}), "
            "e.g. from tensor parallelism: pass the data-parallel submesh of the same parent mesh, "
            "e.g. simplefsdp.wrap(model, world_mesh['dp'])"
        )


def _device_type(params: dict[str, nn.Parameter]) -> str:
    types = {p.device.type for p in params.values()}
    if types == {"meta"}:  # built on the meta device: the mesh goes where materialize() will put it
        return "cuda" if torch.cuda.is_available() else "cpu"
    if len(types) > 1:
        by_type = {t: next(fqn for fqn, p in params.items() if p.device.type == t) for t in sorted(types)}
        raise ValueError(f"parameters live on several device types: {by_type} (an example parameter each)")
    return types.pop() if types else "cpu"


def _check_devices(params: dict[str, nn.Parameter], mesh: DeviceMesh) -> None:
    for fqn, param in params.items():
        if param.device.type not in (mesh.device_type, "meta"):
            raise ValueError(
                f"parameter {fqn!r} is on device {param.device} but the mesh is on {mesh.device_type!r}; "
                f"move the model with model.to({mesh.device_type!r}) before wrapping, or build the mesh on "
                f"{param.device.type!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Settings:
    """What every parameter of one `wrap()` call shares."""

    mesh: DeviceMesh
    strategy: ShardingStrategy
    mp_policy: MixedPrecisionPolicy
    reduce_op: ReduceOp
    reshard_after_forward: bool
    accumulation: Accumulation
    wrap_id: int  # tells apart the tied parameters of different wrapped models
    offload: OffloadPolicy | OffloadPlan | None  # what lives in host memory
    host_device: torch.device  # where gathers copy offloaded shards to

    def host_of(self, fqn: str) -> HostShard | None:
        """How gathers reach the parameter `fqn` if it is offloaded; None if it stays on the device."""
        policy = self.offload.policy_for(fqn) if isinstance(self.offload, OffloadPlan) else self.offload
        return _host_shard(policy, self.host_device)


def _shard_parameters(model: nn.Module, params: dict[str, nn.Parameter], settings: _Settings) -> bool:
    """Replace each floating-point parameter by its sharded DTensor (a tied one by one object) and make
    each module holding one gather it on access; returns whether any parameter is tied."""
    sharded: dict[int, nn.Parameter] = {}  # id(original) -> sharded; tied parameters stay one object
    layouts: dict[int, TensorParallelLayout | None] = {}  # id(original) -> its TP layout, if any
    fqns = {id(p): fqn for fqn, p in params.items()}  # a tied parameter is named by its first FQN
    holders = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    for module in model.modules():
        specs: dict[str, GatherSpec] = {}
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            fqn = fqns[id(param)]
            first = id(param) not in sharded
            host = settings.host_of(fqn)
            if first:
                sharded[id(param)], layouts[id(param)] = _shard(param, settings, fqn=fqn, host=host)
                if host is not None and host.keep_device_copy:
                    dtype = settings.mp_policy.compute_dtype(sharded[id(param)].dtype)
                    attach_device_copy(sharded[id(param)], device=host.device, dtype=dtype)
            tied_key = f"{settings.wrap_id}/{fqn}" if holders[id(param)] > 1 else None
            specs[name] = _spec(
                sharded[id(param)], settings, fqn=fqn, tied_key=tied_key, layout=layouts[id(param)], host=host
            )
            if first:
                settings.accumulation.add_parameter(
                    fqn,
                    sharded[id(param)],
                    grad_dtype=specs[name].reduce_dtype,
                    reduce=functools.partial(reduce_deferred, sharded[id(param)], specs[name]),
                    compute_device=None if host is None else host.device,
                )
        for name in specs:
            module._parameters[name] = sharded[id(module._parameters[name])]
        if specs:
            repoint_caches(module)
            gather_on_access(module, specs)
    return any(n > 1 for n in holders.values())


def _spec(
    param: nn.Parameter,
    settings: _Settings,
    *,
    fqn: str,
    tied_key: str | None,
    layout: TensorParallelLayout | None,
    host: HostShard | None,
) -> GatherSpec:
    """How the sharded master `param` is gathered and its gradient reduced."""
    return GatherSpec(
        fqn=fqn,
        mesh_ndim=settings.mesh.ndim,
        param_dtype=settings.mp_policy.compute_dtype(param.dtype),
        reduce_dtype=settings.mp_policy.reduction_dtype(param.dtype),
        reduce_op=settings.reduce_op,
        reshard_after_forward=settings.reshard_after_forward,
        tied_key=tied_key,
        accumulation=settings.accumulation,
        tp=layout,
        host=host,
        device_copy=device_copy_of(param),
        quantized=_quantized(settings.mp_policy),
    )


def _quantized(policy: MixedPrecisionPolicy) -> QuantizedGather | None:
    if policy.gather_dtype is None:
        return None
    return QuantizedGather(gather_dtype=policy.gather_dtype, block=policy.gather_block)


def _shard(
    param: nn.Parameter, settings: _Settings, *, fqn: str, host: HostShard | None
) -> tuple[nn.Parameter, TensorParallelLayout | None]:
    """`param` sharded over the mesh (a TP DTensor: over the mesh and its tp mesh, with its layout),
    cast to its master dtype after sharding (see [Note: full-precision masters] in mixed_precision.py)."""
    mesh = settings.mesh
    placements = settings.strategy.placements(param_ndim=param.ndim)
    # distribute_tensor takes rank 0's values, so ranks that initialised differently still agree;
    # a meta parameter has no values: each rank makes its (meta) shard locally.
    source = None if param.is_meta else 0
    layout = None
    if isinstance(param, DTensor):
        value, layout = shard_tensor_parallel(
            param.detach(), fqn=fqn, dp_mesh=mesh, dp_placements=placements, src_data_rank=source
        )
    else:
        value = distribute_tensor(param.detach(), mesh, placements, src_data_rank=source)
    value = value.to(settings.mp_policy.master_dtype(param.dtype))
    if host is not None:
        value = on_host(value, pin_memory=host.pin_memory)
    sharded = nn.Parameter(value, requires_grad=param.requires_grad)
    sharded.__dict__.update(param.__dict__)  # keep user tags such as `_no_weight_decay`
    return sharded, layout


def _install_on_root(model: nn.Module, settings: _Settings, *, passes: PassConfig | None, has_tied: bool) -> None:
    """What acts on the whole model: forward input casts, the tied-parameter scope, the `no_sync`
    state, the compiler pass, and the compile-cache keys of its DTensors."""
    settings.mp_policy.install_casts(model)
    if has_tied:
        install_scope(model)
    if any(device_copy_of(p) is not None for p in model.parameters()):
        # masters written by load_state_dict reach the copies the device keeps
        model.register_load_state_dict_post_hook(refresh_after_load)
    attach(model, settings.accumulation)
    # A torch bug (compile caches keyed without the rank's local shard: ranks sharing a cache
    # directory could load each other's graphs) is worked around for the DTensors of these
    # parameters' meshes, while the model compiles only; see [Note: per-rank AOTAutograd cache keys
    # for DTensor inputs] in _compat.py.
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    attach_pass(model, make_pass(model, passes, settings.mesh), cache_key_meshes=meshes)
    setattr(model, _ROOT_ATTR, True)


def _install_regions(model: nn.Module, passes: PassConfig | None) -> None:
    if passes is not None and passes.bucket is not None and passes.bucket.plan == "auto":
        # the auto plan prices each op of the traced graphs; a region's ops sit in its body
        logger.info("simplefsdp: the auto bucket plan compiles every block (compile_regions off)")
        return
    if not regions_supported():
        logger.warning(
            "simplefsdp: torch %s has no reusable nested compile regions; compiling every block", torch.__version__
        )
        return
    install_regions(model, find_repeated_blocks(model))


def make_pass(model: nn.Module, passes: PassConfig | None, mesh: DeviceMesh) -> FsdpPass | None:
    """The model's pass, acting on the collectives of `mesh`'s groups only; the default block plan
    gets its blocks from the model's structure."""
    if passes is None:
        return None
    bucket = passes.bucket
    if bucket is not None and bucket.plan == "blocks" and not bucket.blocks:
        blocks = tuple(find_repeated_blocks(model))
        if blocks:
            bucket = dataclasses.replace(bucket, blocks=blocks)
        else:
            # [Note: no repeated blocks] the block plan would then put every parameter in one
            # bucket: the whole model gathered at once at the first use, DDP's memory
            logger.warning(
                "simplefsdp: %s has no repeated blocks (two or more children of one class in a ModuleList, "
                "Sequential or ModuleDict); bucketing in graph order, at most %d bytes per bucket, instead. "
                "Pick buckets with BucketConfig(plan='patterns', patterns=(...)).",
                user_class(model).__name__,
                bucket.cap_bytes,
            )
            bucket = dataclasses.replace(bucket, plan="cap")
    groups = [tuple(dist.get_process_group_ranks(mesh.get_group(dim))) for dim in range(mesh.ndim)]
    return FsdpPass(dataclasses.replace(passes, bucket=bucket), groups=groups)
