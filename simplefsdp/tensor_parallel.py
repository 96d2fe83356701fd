"""Composition with tensor parallelism: a TP DTensor parameter sharded once more over the data-parallel mesh.

A model parallelized with `torch.distributed.tensor.parallel.parallelize_module` on the `tp` dim
of a mesh holds DTensor parameters on the tp submesh (ColwiseParallel: `Shard(0)`,
RowwiseParallel: `Shard(1)`, SequenceParallel norms: `Replicate()`). `wrap(model, mesh["dp"])`
shards each rank's TP-local tensor over the dp mesh, exactly as it shards a plain parameter, and
records the result as one DTensor on the combined mesh `(*dp dims, *tp dims)`:

    placements = (*dp placements, *tp placements)

where a dp `Shard(0)` becomes `_StridedShard(0, split_factor=tp size)` when TP shards dim 0 too:
the dp shard is a chunk of this rank's TP chunk, not a chunk of the global tensor, and the strided
placement says so, so `full_tensor()`, optimizers, `clip_grad_norm_` and checkpoints see the true
global parameter.

[Note: the gather goes through the dp mesh only]
At use, `dp_view` re-reads the combined DTensor's local shard as a DTensor on the dp mesh over the
TP-local shape; the ordinary FSDP gather (`gather.py`) all-gathers it over dp (and reduces its
gradient over dp); `as_tensor_parallel` re-reads the gathered TP-local tensor as the DTensor on
the tp mesh that the TP-parallelized module computes with. Both re-readings are `from_local`
without communication, so the only collectives the gather adds run on the dp group, and the
TP collectives stay where TP put them (on activations, or the tp reduction of a replicated
parameter's gradient, which `from_local`'s backward performs outside the gather's tagged region,
so the passes never mistake it for an FSDP reduction).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from simplefsdp._compat import StridedShard, root_mesh

__all__ = ["TensorParallelLayout", "check_tensor_parallel", "combined_mesh", "shard_tensor_parallel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallelLayout:
    """Where one TP parameter lives: its TP placement, this rank's TP-local shape, its dp sharding.

    Invariant: the parameter is a DTensor on the mesh `(*dp_mesh dims, *tp_mesh dims)` with the
    placements `(*dp_placements, *tp_placements)`, except that a dp `Shard(0)` is strided where TP
    shards dim 0 too; its local tensor is this rank's dp chunk of a TP-local tensor of `local_shape`.
    """

    dp_mesh: DeviceMesh
    dp_placements: tuple[Placement, ...]
    tp_mesh: DeviceMesh
    tp_placements: tuple[Placement, ...]
    local_shape: torch.Size  # this rank's TP-local (dp-unsharded) shape
    local_stride: tuple[int, ...]  # its contiguous stride
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global (contiguous) stride

    def dp_view(self, param: DTensor) -> DTensor:
        """`param`'s local shard as a DTensor on the dp mesh over this rank's TP-local tensor (no communication)."""
        local = param.to_local()  # its gradient comes back with `param`'s combined placements
        return DTensor.from_local(
            local,
            self.dp_mesh,
            self.dp_placements,
            run_check=False,
            shape=self.local_shape,
            stride=self.local_stride,
        )

    def as_tensor_parallel(self, local: torch.Tensor) -> DTensor:
        """The gathered TP-local tensor as the TP DTensor the parallelized module expects (no communication)."""
        return DTensor.from_local(
            local, self.tp_mesh, self.tp_placements, run_check=False, shape=self.shape, stride=self.stride
        )


def _names(mesh: DeviceMesh, what: str, *, fqn: str) -> tuple[str, ...]:
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"parameter {fqn!r} is already a DTensor, which wrap() accepts from tensor parallelism only, "
            f"on named meshes; the {what} mesh {mesh} has no dim names: build one mesh with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and pass its named submeshes "
            "(world['tp'] to parallelize_module, world['dp'] to wrap)"
        )
    return tuple(mesh.mesh_dim_names)


def combined_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, *, fqn: str) -> DeviceMesh:
    """The submesh `(*dp dims, *tp dims)` of the mesh both were sliced from.

    Raises a `ValueError` naming the parameter when the two meshes do not come from one parent
    mesh, share a dim, or the dp dims do not come before the tp dims in the parent.
    """
    dp_names, tp_names = _names(dp_mesh, "data-parallel", fqn=fqn), _names(tp_mesh, "parameter's", fqn=fqn)
    # The dp mesh's parent must hold the tp dims, and slicing them from it must give the very mesh
    # the parameter lives on (compared by value: torch caches equal submeshes and specs, so the
    # parameter's mesh object may come from another, equal, parent).
    root = root_mesh(dp_mesh)
    parent_names = tuple(root.mesh_dim_names or ())
    if not set(tp_names) <= set(parent_names) or root[tp_names if len(tp_names) > 1 else tp_names[0]] != tp_mesh:
        raise ValueError(
            f"parameter {fqn!r} is tensor-parallel on {tp_mesh} (dims {tp_names}), but the data-parallel mesh "
            f"{dp_mesh} (dims {dp_names}) is not part of the same parent mesh (its parent has dims {parent_names}); "
            "slice both from one mesh, e.g. world = init_device_mesh(..., mesh_dim_names=('dp', 'tp')), "
            "parallelize_module(model, world['tp'], plan), simplefsdp.wrap(model, world['dp'])"
        )
    if set(dp_names) & set(tp_names):
        raise ValueError(f"the data-parallel mesh dims {dp_names} overlap parameter {fqn!r}'s tp dims {tp_names}")
    order = [root.mesh_dim_names.index(n) for n in dp_names + tp_names]
    if order != sorted(order):
        raise ValueError(
            f"in the parent mesh (dims {root.mesh_dim_names}) the data-parallel dims {dp_names} must come before "
            f"parameter {fqn!r}'s tensor-parallel dims {tp_names}"
        )
    return root[dp_names + tp_names]


def _composed(dp_placements: tuple[Placement, ...], tp: DTensor) -> tuple[Placement, ...]:
    """dp placements with `Shard(0)` made strided where TP also shards dim 0 (see the module docstring)."""
    split = 1
    for placement, size in zip(tp.placements, tp.device_mesh.shape, strict=True):
        if isinstance(placement, Shard) and placement.dim == 0:
            split *= size
    return tuple(
        StridedShard(0, split_factor=split) if split > 1 and isinstance(p, Shard) and p.dim == 0 else p
        for p in dp_placements
    )


def check_tensor_parallel(param: DTensor, *, dp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The combined mesh `param` (a TP DTensor) will live on; a `ValueError` naming it if it cannot."""
    if any(placement.is_partial() for placement in param.placements):
        raise ValueError(
            f"parameter {fqn!r} is a Partial DTensor ({param.placements} on {param.device_mesh}); "
            "expected Shard or Replicate placements from tensor parallelism"
        )
    return combined_mesh(dp_mesh, param.device_mesh, fqn=fqn)


def shard_tensor_parallel(
    param: DTensor,
    *,
    fqn: str,
    dp_mesh: DeviceMesh,
    dp_placements: tuple[Placement, ...],
    src_data_rank: int | None,
) -> tuple[DTensor, TensorParallelLayout]:
    """`param` (a TP DTensor) sharded over `dp_mesh` too: the combined-mesh DTensor and its layout.

    Each rank keeps a chunk of its TP-local tensor, taken from dp rank `src_data_rank`'s values
    (`None`: from its own, without communication); no rank holds more than its TP-local tensor.
    """
    mesh = check_tensor_parallel(param, dp_mesh=dp_mesh, fqn=fqn)
    local = param.to_local()
    layout = TensorParallelLayout(
        dp_mesh=dp_mesh,
        dp_placements=dp_placements,
        tp_mesh=param.device_mesh,
        tp_placements=tuple(param.placements),
        local_shape=local.shape,
        local_stride=torch.empty(local.shape, device="meta").stride(),
        shape=param.shape,
        stride=tuple(param.stride()),
    )
    dp_shard = distribute_tensor(local.detach(), dp_mesh, dp_placements, src_data_rank=src_data_rank).to_local()
    combined = DTensor.from_local(
        dp_shard,
        mesh,
        (*_composed(dp_placements, param), *param.placements),
        run_check=False,
        shape=param.shape,
        stride=tuple(param.stride()),
    )
    return combined, layout
