"""Rank 0's values for what `wrap()` leaves replicated: buffers and non-floating-point parameters.

[Note: replicated state starts from rank 0]
`wrap()` shards each floating-point parameter from rank 0's values (`distribute_tensor` with
`src_data_rank=0`), so ranks that initialised with different seeds still train one model. The
state it does not shard -- buffers (BatchNorm's running statistics, a rotary table, a step
counter) and integer or boolean parameters -- is kept whole on every rank, and must start equal
for the same reason: a rank whose running mean differs evaluates a different model, silently.
So these take rank 0's values too, broadcast in place over every dimension of the mesh (the
tensors keep their identity: a module holding a reference still sees its buffer). Meta tensors
have no values yet (`materialize` initialises them later, identically on every rank) and are
skipped, as are DTensors, which a tensor-parallel plan already placed.

[Note: BatchNorm in training mode]
After `wrap()`, buffers are per-rank state again. A BatchNorm in training mode normalises each
rank's batch by that batch's own statistics and updates its running statistics from them (what
DDP without `SyncBatchNorm` and FSDP2 do; DDP's default also overwrites them with rank 0's at every
forward, which is not done here): the gradients are those of the mean of the ranks' losses, each
computed with its own batch statistics, and the ranks' running statistics drift apart. Both
checkpoint formats store rank 0's (the sharded save writes every replicated tensor from rank 0), so
a model loaded from a checkpoint starts with rank 0's statistics on every rank. For statistics over
the whole global batch, convert the model with `nn.SyncBatchNorm.convert_sync_batchnorm` before
wrapping: its parameters are sharded and gathered like BatchNorm's, and its forward synchronises
the statistics itself -- on GPUs only (torch has no CPU kernels for it and refuses CPU inputs in
training mode).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["broadcast_replicated"]


def _replicated_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers and non-floating-point parameters of `model` that hold values, each once."""
    seen: set[int] = set()
    state = []
    named = [*model.named_buffers(), *((n, p) for n, p in model.named_parameters() if not p.is_floating_point())]
    for fqn, tensor in named:
        if tensor is None or tensor.is_meta or isinstance(tensor, DTensor) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        state.append((fqn, tensor))
    return state


def broadcast_replicated(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Give every rank of `mesh` the values its first rank holds for `model`'s replicated state (see
    the module note), in place; returns the FQNs broadcast. One collective per tensor per mesh
    dimension: this runs once, at wrap time."""
    state = _replicated_state(model)
    with torch.no_grad():
        for _, tensor in state:
            # gloo and NCCL broadcast bytes of numeric types; a bool tensor travels as its bytes
            payload = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
            for dim in range(mesh.ndim):  # dim 0 first: then dim 1 spreads what coordinate 0 now holds
                group = mesh.get_group(dim)
                moved = payload.to(mesh.device_type).contiguous()  # itself when already both
                dist.broadcast(moved, group=group, group_src=0)
                if moved is not payload:
                    payload.copy_(moved)
    return [fqn for fqn, _ in state]
