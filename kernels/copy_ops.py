"""The three bucket copy ops as `torch.library` operators: `torch.ops.simplefsdp.<name>`.

Semantics: `reference.py`. Each op has a Triton implementation (one kernel launch per bucket,
`triton_copy.py`; [Note: kernel selection] says where it runs), a torch-ops implementation (the
CPU's, and any device's without Triton: one `cat` / `split` after per-parameter
cast + pad, the same work as the unfused sequence it replaces) and a fake implementation, so the
ops trace under torch.compile. Inputs are checked up front; a bad one raises a `ValueError`
naming the argument and position. A fourth op, `rank_slot`, copies this rank's slot out of a
buffer every rank reduced in place (gloo's reduce-scatter bucket): plain torch on every device.

All-gather copy-out returns fresh tensors (not views): a parameter's full value spans every rank
slot of the gathered buffer, `[world, bucket]` rows apart, so only a one-parameter bucket could be
viewed; the copy is one read and one write per element.

[Note: no reduce-scatter copy-out op]
A reduce-scatter's result needs no copy-out: each parameter's shard gradient is a contiguous run of
this rank's reduced slot, in the reduction dtype, so the bucketing pass unpacks it with views. The
cast back to the master dtype (mixed precision) stays the graph's own op, which inductor fuses with
its consumers; a custom op there would read and write the same bytes and hide the cast from fusion.

`ALL_GATHER_COPY_IN`, `ALL_GATHER_COPY_OUT`, `REDUCE_SCATTER_COPY_IN` and `RANK_SLOT` are the ops' overloads as
they appear as FX node targets; importing this module is what registers them, so code that names
them imports them from here (never `torch.ops.simplefsdp.*` at import time, which would depend on
another module having registered them first).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence

import torch

from simplefsdp._compat import OpOverload, chunk_cat, foreach_copy_, resolve_process_group
from simplefsdp.kernels import reference

__all__ = [
    "ALL_GATHER_COPY_IN",
    "ALL_GATHER_COPY_OUT",
    "FAKE_IMPLS",
    "RANK_SLOT",
    "REDUCE_SCATTER_COPY_IN",
    "SUPPORTED_DTYPES",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "rank_slot",
    "reduce_scatter_copy_in",
    "split_shapes",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the ops read and write


_log = logging.getLogger(__name__)

# [Note: not inside CUDA graphs]
# The Triton path hands the kernel a table of data pointers that it builds on the host and copies to
# the device whenever that exact table was not sent before (`triton_copy.py`). A CUDA graph would
# capture one call's table and replay it with stale addresses, so the ops are tagged `cudagraph_unsafe`: under
# `torch.compile(mode="reduce-overhead")` inductor leaves them (and runs the rest in CUDA graphs).
_TAGS = (torch.Tag.cudagraph_unsafe, torch.Tag.pt2_compliant_tag)

# [Note: registered on the library, not with custom_op]
# `torch.library.custom_op` would register these ops in one decorator, but every call then passes a
# Python autograd kernel and a redispatch before the implementation runs: tens of microseconds more
# per call than the same function registered below, as much as the copy itself for small buckets
# (bench/results/measurements.md, "copy ops") -- and a compiled step calls these ops two or three times per bucket.
# They only ever run inside compiled graphs, on tensors that need no gradient, so they are defined
# on a `torch.library.Library` with one `CompositeExplicitAutograd` kernel (every device; the device
# choice is [Note: kernel selection]) and a fake kernel, and no autograd formula: called on an input
# that requires grad while grad mode is on, they raise (`_check_tensors`) rather than record a
# backward through their insides.
_LIB = torch.library.Library("simplefsdp", "DEF")  # the ops live as long as this module holds it


def _use_triton(t: torch.Tensor) -> bool:
    """[Note: kernel selection]
    The Triton kernel runs where it imports and supports the tensor's device (`triton_copy.supports`):
    a CUDA (or ROCm) GPU, or the CPU when `SIMPLEFSDP_TRITON_ON_CPU=1` routes CPU tensors to it and
    Triton's interpreter is on (`TRITON_INTERPRET=1` before import; the kernel tests' route). Anywhere
    else -- no Triton installed (e.g. aarch64, which the dependency marker leaves out), no driver, other
    devices -- the torch-ops implementations run, which compute the same results. The choice is made
    once per device type and logged at INFO with its reason."""
    return _kernel_choice(t.device.type, os.environ.get("SIMPLEFSDP_TRITON_ON_CPU") == "1")


@functools.cache
def _kernel_choice(device_type: str, triton_on_cpu: bool) -> bool:
    if device_type == "cpu" and not triton_on_cpu:
        why = "CPU tensors (SIMPLEFSDP_TRITON_ON_CPU=1 routes them to Triton's interpreter)"
    else:
        try:
            from simplefsdp.kernels import triton_copy
        except ImportError as e:
            why = f"Triton does not import ({e})"
        else:
            why = triton_copy.supports(torch.device(device_type))
    if why is None:
        _log.info("simplefsdp copy ops on %s: Triton kernel", device_type)
    else:
        _log.info("simplefsdp copy ops on %s: torch ops; %s", device_type, why)
    return why is None


def _check_dtype(what: str, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} has dtype {dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")


def _check_tensors(what: str, tensors: Sequence[torch.Tensor]) -> None:
    """Dtypes supported, and no gradient to record ([Note: registered on the library, not with custom_op])."""
    grad = torch.is_grad_enabled()
    for i, t in enumerate(tensors):
        _check_dtype(f"{what}[{i}]", t.dtype)
        if grad and t.requires_grad:
            raise ValueError(f"{what}[{i}] requires grad: the copy ops have no derivative; call them under no_grad")


# [Note: any input layout]
# The ops read every tensor input in its logical (row-major) element order, whatever its strides:
# the compiler decides layouts, and on the CPU inductor hands convolution weights and their
# gradients back channels-last (and may pass a saved shard to backward in that layout). The CPU
# paths read strided directly (`copy_` / `_chunk_cat` walk the strides, no temporary); the Triton
# path reads flat, so a non-contiguous input costs one `contiguous()` copy first
# (`_flat`), paid only by the inputs that need it.
def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements in logical order, 1-D and contiguous (the kernel indexes flat memory): a view
    when `t` is contiguous, else a copy (`reshape` alone could return a strided 1-D view)."""
    return t.contiguous().view(-1)


def _check_slot(shards: Sequence[torch.Tensor], chunks: Sequence[int]) -> None:
    """An all-gather copy-in's slot: one chunk per shard, each shard within its chunk."""
    _check_chunks(chunks, len(shards))
    for i, (s, c) in enumerate(zip(shards, chunks, strict=True)):
        if s.numel() > c:
            raise ValueError(f"shards[{i}] has {s.numel()} elements, more than its chunk of {c}")


def _check_chunks(chunks: Sequence[int], n: int) -> None:
    """`chunks` are >= 0, one per tensor."""
    if len(chunks) != n:
        raise ValueError(f"got {len(chunks)} chunk sizes for {n} tensors")
    bad = [i for i, c in enumerate(chunks) if c < 0]
    if bad:
        raise ValueError(f"chunk sizes must be >= 0; chunks{bad} are negative")


# [Note: CPU implementations] The CPU paths are the unfused torch sequences FSDP2 runs, minus its
# extra temporaries where that measured faster on a 2-core x86 CPU (`python bench/copy_kernels.py --cpu`):
# all-gather copy-in is one `_foreach_copy_` that casts each shard straight into its place in the
# slot (no cast temporaries, no separate padded copies); copy-out is `split_with_sizes_copy`;
# reduce-scatter copy-in casts first when it must (`_chunk_cat` converting dtypes on the fly is
# slower than a cast followed by a same-dtype `_chunk_cat`) and then chunk-cats into the output.
# `reference.py` stays the specification the tests compare them with.
def _cpu_all_gather_copy_in(shards: list[torch.Tensor], chunks: list[int], slot: torch.Tensor) -> None:
    places = slot.split(chunks)
    if not shards:
        return
    foreach_copy_([p[: s.numel()].view(s.shape) for p, s in zip(places, shards, strict=True)], list(shards))
    for place, shard in zip(places, shards, strict=True):
        if shard.numel() < place.numel():  # a short last shard, or dim 0 not a multiple of world
            place[shard.numel() :].zero_()


def _cpu_all_gather_copy_out(
    gathered: torch.Tensor, chunks: list[int], shapes: list[list[int]], world: int
) -> list[torch.Tensor]:
    outs = [gathered.new_empty(world, c) for c in chunks]
    torch.split_with_sizes_copy(gathered.reshape(world, -1), chunks, dim=1, out=outs)
    return [out.view(-1)[: math.prod(shape)].view(shape) for out, shape in zip(outs, shapes, strict=True)]


def split_shapes(sizes: Sequence[int], ndims: Sequence[int]) -> list[list[int]]:
    """The shapes `sizes` holds back to back, `ndims[i]` dims for the i-th (a custom op's schema
    cannot take a list of lists)."""
    if sum(ndims) != len(sizes) or any(n < 0 for n in ndims):
        raise ValueError(f"ndims {list(ndims)} do not split the {len(sizes)} sizes {list(sizes)}")
    bounds = [0, *itertools.accumulate(ndims)]
    return [list(sizes[start:end]) for start, end in itertools.pairwise(bounds)]


def _cpu_reduce_scatter_copy_in(
    grads: list[torch.Tensor], world: int, dtype: torch.dtype, scale: float
) -> torch.Tensor:
    chunks = [reference.chunk_numel(g.shape, world) for g in grads]
    device = grads[0].device if grads else torch.device("cpu")
    out = torch.empty(world, sum(chunks), dtype=dtype, device=device)
    cast = [g if g.dtype == dtype and scale == 1.0 else reference.cast(g, dtype, scale) for g in grads]
    nonempty = [g.reshape(-1) if g.dim() == 0 else g for g in cast if g.numel()]  # _chunk_cat rejects empties
    if nonempty:
        chunk_cat(nonempty, dim=0, num_chunks=world, out=out)
    return out.view(-1)


def _register(schema: str, impl: Callable, fake: Callable) -> OpOverload:
    """Define `simplefsdp::<schema>` with `impl` for every device and `fake` for tracing; its overload."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=_TAGS)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"simplefsdp::{name}", fake, lib=_LIB)
    return getattr(torch.ops.simplefsdp, name).default


# --- all-gather copy-in -------------------------------------------------------------------------


def _all_gather_copy_in(shards: list[torch.Tensor], chunks: list[int], dtype: torch.dtype) -> torch.Tensor:
    """This rank's `[bucket]` all-gather slot, a new tensor: its shards (any shape and layout: read
    in logical order), cast to `dtype`, each zero-padded to its chunk, concatenated
    ([Note: no rank in the graph] in `passes/bucket.py`: the all-gather places it)."""
    _check_tensors("shards", shards)
    _check_dtype("dtype", dtype)
    _check_slot(shards, chunks)
    device = shards[0].device if shards else torch.device("cpu")
    slot = torch.empty(sum(chunks), dtype=dtype, device=device)
    if not shards or not _use_triton(shards[0]):
        _cpu_all_gather_copy_in(shards, chunks, slot)
        return slot
    from simplefsdp.kernels import triton_copy

    triton_copy.pack([_flat(s) for s in shards], list(chunks), slot, rows=1)
    return slot


def _all_gather_copy_in_fake(shards, chunks, dtype):
    device = shards[0].device if shards else torch.device("cpu")
    return torch.empty(sum(chunks), dtype=dtype, device=device)


ALL_GATHER_COPY_IN = _register(
    "all_gather_copy_in(Tensor[] shards, SymInt[] chunks, ScalarType dtype) -> Tensor",
    _all_gather_copy_in,
    _all_gather_copy_in_fake,
)


# --- all-gather copy-out ------------------------------------------------------------------------


def _all_gather_copy_out(
    gathered: torch.Tensor, chunks: list[int], sizes: list[int], ndims: list[int], world: int
) -> list[torch.Tensor]:
    """Each parameter's full value, padding stripped, in its shape (`split_shapes(sizes, ndims)`),
    from the gathered `[world * bucket]` buffer."""
    _check_tensors("gathered", [gathered])
    shapes = split_shapes(sizes, ndims)
    _check_chunks(chunks, len(shapes))
    if gathered.numel() != world * sum(chunks):
        raise ValueError(f"gathered has {gathered.numel()} elements; world {world} x bucket {sum(chunks)} expected")
    for i, (c, shape) in enumerate(zip(chunks, shapes, strict=True)):
        if any(d < 0 for d in shape) or math.prod(shape) > world * c:
            raise ValueError(f"shape {shape} of output {i} does not fit {world} chunks of {c}")
    if not _use_triton(gathered):
        return _cpu_all_gather_copy_out(gathered, list(chunks), shapes, world)
    from simplefsdp.kernels import triton_copy

    outs = [torch.empty(shape, dtype=gathered.dtype, device=gathered.device) for shape in shapes]
    triton_copy.unpack(_flat(gathered), list(chunks), [out.view(-1) for out in outs], rows=world)
    return outs


def _all_gather_copy_out_fake(gathered, chunks, sizes, ndims, world):
    return [gathered.new_empty(shape) for shape in split_shapes(sizes, ndims)]


ALL_GATHER_COPY_OUT = _register(
    "all_gather_copy_out(Tensor gathered, SymInt[] chunks, SymInt[] sizes, SymInt[] ndims, SymInt world) -> Tensor[]",
    _all_gather_copy_out,
    _all_gather_copy_out_fake,
)


# --- reduce-scatter copy-in ---------------------------------------------------------------------


def _reduce_scatter_copy_in(grads: list[torch.Tensor], world: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The `[world * bucket]` reduce-scatter input: gradients cast (times `scale`), padded, rank chunks interleaved."""
    _check_tensors("grads", grads)
    _check_dtype("dtype", dtype)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not grads or not _use_triton(grads[0]):
        return _cpu_reduce_scatter_copy_in(grads, world, dtype, scale)
    from simplefsdp.kernels import triton_copy

    chunks = [reference.chunk_numel(g.shape, world) for g in grads]
    out = torch.empty(world * sum(chunks), dtype=dtype, device=grads[0].device)
    triton_copy.pack([_flat(g) for g in grads], chunks, out, rows=world, scale=scale)
    return out


def _reduce_scatter_copy_in_fake(grads, world, dtype, scale):
    device = grads[0].device if grads else torch.device("cpu")
    return torch.empty(world * sum(reference.chunk_numel(g.shape, world) for g in grads), dtype=dtype, device=device)


REDUCE_SCATTER_COPY_IN = _register(
    "reduce_scatter_copy_in(Tensor[] grads, SymInt world, ScalarType dtype, float scale) -> Tensor",
    _reduce_scatter_copy_in,
    _reduce_scatter_copy_in_fake,
)

# --- rank slot ---------------------------------------------------------------------------------


def _rank_slot(buffer: torch.Tensor, group_name: str, n: int) -> torch.Tensor:
    """A new `[n]` tensor: slot `rank` of the flat `buffer`, `rank` this process's rank in process group
    `group_name`, read when the op runs ([Note: no rank in the graph] in `passes/bucket.py`)."""
    rank = resolve_process_group(group_name).rank()
    if n < 0 or buffer.dim() != 1 or buffer.numel() < (rank + 1) * n:
        raise ValueError(f"buffer of shape {list(buffer.shape)} has no slot {rank} of {n} elements")
    return buffer.narrow(0, rank * n, n).clone()


def _rank_slot_fake(buffer, group_name, n):
    return buffer.new_empty(n)


RANK_SLOT = _register("rank_slot(Tensor buffer, str group_name, SymInt n) -> Tensor", _rank_slot, _rank_slot_fake)

# the ops to call: `torch.ops.simplefsdp.<name>` (the packets dispatch to their one overload)
all_gather_copy_in = torch.ops.simplefsdp.all_gather_copy_in
all_gather_copy_out = torch.ops.simplefsdp.all_gather_copy_out
reduce_scatter_copy_in = torch.ops.simplefsdp.reduce_scatter_copy_in
rank_slot = torch.ops.simplefsdp.rank_slot

# [Note: the copy ops' output metadata, directly]
# The graph pass adds hundreds of these ops to a deep model's graph and needs each one's output
# metadata. Run through the dispatcher on fake tensors, each call passes the autograd key, the fake
# mode's dispatch and the fake-tensor cache's key over a list of tensors before it reaches the fake
# function registered above -- more than half of the time the pass spent on these ops (profiled on a
# 64-block backward graph, when they were registered with `custom_op`). The pass calls the
# registered function itself, in the same fake mode (the outputs are then the very tensors the
# dispatcher would have returned).
FAKE_IMPLS = {
    ALL_GATHER_COPY_IN: _all_gather_copy_in_fake,
    ALL_GATHER_COPY_OUT: _all_gather_copy_out_fake,
    REDUCE_SCATTER_COPY_IN: _reduce_scatter_copy_in_fake,
    RANK_SLOT: _rank_slot_fake,
}
