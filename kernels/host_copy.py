"""Copies between host and device memory as an async pair of `torch.library` ops the passes can place.

    token = torch.ops.simplefsdp.copy_start(src, device)   # the copy starts (a side stream on a GPU)
    dst   = torch.ops.simplefsdp.copy_wait(token, src)     # dst: src's value on `device`

`copy_start` allocates the destination on `device`, starts copying `src` into it and returns a
one-byte token on `device` that names the copy in flight; `copy_wait` makes what comes after it
see the finished copy and returns the destination. Host-to-device copies feed an offloaded shard
to its all-gather, device-to-host copies take a reduced gradient shard back to host memory
(`simplefsdp/offload.py`). Between the two ops the graph may run anything: the reorder pass puts
a start ahead of earlier compute and a wait right before the first use
([Note: where offload copies sit] in `passes/host_copies.py`).

On a CUDA device (either end):
- host to device: the copy runs on a side stream, after the work the current stream had queued
  when the copy started (the destination's memory may have been freed by it); the wait makes the
  current stream wait for the copy's event -- the GPU waits, the host does not;
- device to host: the destination is pinned host memory; the wait blocks the host until the copy
  is done (its result is read on the host: the optimizer steps there);
- `pin` (start): the destination of a device-to-host copy is pinned (asked for by the offload policy).
Between two CPU tensors (a CPU mesh: the host is the device) the pair is the identity: the start
copies `src` at once and the wait returns that copy.

[Note: a token, not the buffer]
The wait cannot return its input: a custom op's output must not alias an input (inductor would
treat them as two buffers and may reuse one while the other is read). So the start hands back a
token and keeps the destination in `_IN_FLIGHT`, keyed by the token's address (unique while the
token lives, and the token lives until its wait consumes it); the wait pops it. The liveness walk
charges the destination's bytes from the start on (`passes/liveness.py`), where the memory is
really taken. The wait takes `src` too: its shape, dtype and strides for tracing, and `src` stays
alive until the copy that reads it is done.
"""

from __future__ import annotations

import torch

from simplefsdp._compat import OpOverload

__all__ = ["COPY_START", "COPY_WAIT", "is_copy_start", "is_copy_wait", "lands_on_device"]

_LIB = torch.library.Library("simplefsdp", "FRAGMENT")  # `simplefsdp` is defined by copy_ops.py
_TAGS = (torch.Tag.cudagraph_unsafe, torch.Tag.pt2_compliant_tag)

# token address -> (destination, CUDA event or None); see [Note: a token, not the buffer]
_IN_FLIGHT: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _cuda_end(src: torch.Tensor, device: torch.device) -> torch.device | None:
    """The CUDA device of a copy from `src` to `device`, None when neither end is CUDA."""
    if device.type == "cuda":
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return src.device if src.device.type == "cuda" else None


def _start(src: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    device = torch.device(device)
    token = torch.empty(1, dtype=torch.uint8, device=device)
    cuda = _cuda_end(src, device)
    if cuda is None:
        dst, event = src.to(device, copy=True), None
    else:
        to_host = device.type == "cpu"
        dst = torch.empty_like(src, device=device, memory_format=torch.contiguous_format, pin_memory=pin and to_host)
        current, side = torch.cuda.current_stream(cuda), _side_stream(cuda)
        side.wait_stream(current)  # src is ready, dst's memory free
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        # the caching allocator must not hand out a device buffer the side stream still uses
        (src if to_host else dst).record_stream(side)
    _IN_FLIGHT[token.data_ptr()] = (dst, event)
    return token


def _start_fake(src: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    return src.new_empty(1, dtype=torch.uint8, device=device)


def _wait(token: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    try:
        dst, event = _IN_FLIGHT.pop(token.data_ptr())
    except KeyError:
        raise RuntimeError("simplefsdp.copy_wait: no copy in flight for this token (waited twice?)") from None
    if event is not None:
        if dst.device.type == "cpu":
            event.synchronize()  # the host reads the result next
        else:
            torch.cuda.current_stream(dst.device).wait_event(event)
    return dst


def _wait_fake(token: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(src, device=token.device, memory_format=torch.contiguous_format)


def _register(schema: str, impl, fake) -> OpOverload:
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=_TAGS)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"simplefsdp::{name}", fake, lib=_LIB)
    return getattr(torch.ops.simplefsdp, name).default


COPY_START = _register("copy_start(Tensor src, Device device, bool pin=False) -> Tensor", _start, _start_fake)
COPY_WAIT = _register("copy_wait(Tensor token, Tensor src) -> Tensor", _wait, _wait_fake)


def is_copy_start(node) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is COPY_START


def is_copy_wait(node) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is COPY_WAIT


def lands_on_device(start) -> bool:
    """Whether the copy `start` (a `copy_start` node) lands in device memory: host to device, or a
    copy between two CPU tensors (a CPU mesh, where the host is the device)."""
    src, token = start.args[0].meta["val"], start.meta["val"]
    return token.device.type != "cpu" or src.device.type == "cpu"
