"""Measure the tensor memory a piece of code allocates: the CPU analogue of a GPU's allocated bytes.

    with LiveTensorBytes() as live:
        loss_fn(model(batch)).backward()
    live.peak_bytes   # the most bytes of storages created inside the block alive at one time

On a GPU, `torch.cuda.max_memory_allocated` counts the bytes of live tensor storages (rounded to the
allocator's blocks); on the CPU the process's resident memory also counts the allocator's retained
pages, thread arenas and the communication library, which the dry run's prediction does not model.
This counts what the prediction does: each storage an op dispatched inside the block returns, from
its creation until it is freed.

[Note: how storages are followed]
A `TorchDispatchMode` sees every op dispatched inside the block (eager code and the op-by-op
`aot_eager` backends; not inductor's generated kernels, whose buffers are allocated without
dispatch). For each output tensor whose storage it has not seen, it adds the storage's bytes and
registers a finalizer on the storage's Python object -- torch keeps one Python object per storage
while it lives -- that subtracts them when the storage is freed. Views and in-place results share
a storage and count once: an output whose storage is one of the op's inputs' is not new (`detach`
of a parameter, `add_`), whichever side of the block that storage was created on. So storages
created before the block (parameters, optimizer state) are never counted: add them yourself.

[Note: compiled code under the mode]
Dynamo does not compile a frame while a user's dispatch mode is active (it falls back to eager,
which is not the step to measure). This mode declares itself an infrastructure mode, which Dynamo
traces through: it only observes (it returns each op's own result), so the compiled graph is the
same as without it, and at run time the `aot_eager` graph's ops dispatch through it.
"""

from __future__ import annotations

import weakref

import torch

from simplefsdp._compat import TorchDispatchMode, tree_leaves

__all__ = ["LiveTensorBytes", "local_shard", "state_bytes"]


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the storages created inside the block (see the module docstring).
    Invariant: `0 <= live_bytes <= peak_bytes`."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def is_infra_mode(cls) -> bool:
        # see [Note: compiled code under the mode]
        return True

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if id(storage) in inputs or storage in self._seen:  # a view / in-place result: no new bytes
            return
        nbytes = storage.nbytes()
        self._seen.add(storage)
        weakref.finalize(storage, self._freed, nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, inputs)
        return out


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t` (a DTensor), or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters (their local shards) and optimizer state: what a step's
    measured peak adds to the bytes `LiveTensorBytes` counts."""
    params = sum(local_shard(p).numel() * p.element_size() for p in model.parameters())
    states = sum(
        local_shard(v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return params + states
