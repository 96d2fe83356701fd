"""The data-parallel DeviceMesh: the default one, and checks that a given one fits the strategy."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp.strategy import ShardingStrategy

__all__ = ["resolve_mesh"]


def _describe(mesh: DeviceMesh) -> str:
    names = f", dim names {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return f"DeviceMesh({mesh.device_type!r}, shape {tuple(mesh.shape)}{names})"


def resolve_mesh(mesh: DeviceMesh | None, *, strategy: ShardingStrategy, device_type: str) -> DeviceMesh:
    """`mesh` checked against `strategy`, or the default: 1-D over the default process group on `device_type`."""
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "simplefsdp.wrap() needs a process group: call torch.distributed.init_process_group() "
                "(or launch with torchrun) before wrapping, or pass mesh="
            )
        if strategy.is_hybrid:
            raise ValueError(
                f"{strategy.value} needs a 2-D mesh (replicate, shard) and none was given; pass e.g. "
                f"mesh=init_device_mesh({device_type!r}, (num_replicas, shard_size), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != strategy.mesh_ndim:
        layout = "(replicate, shard)" if strategy.is_hybrid else "(dp,)"
        raise ValueError(
            f"{strategy.value} needs a {strategy.mesh_ndim}-D mesh {layout}, got a {mesh.ndim}-D {_describe(mesh)}"
        )
    return mesh
