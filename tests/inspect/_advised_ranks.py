"""Rank-side half of the advisor's memory check: run one advised configuration's step, measure it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.inspect.advise import Choice
from simplefsdp.inspect.capture import default_loss
from simplefsdp.inspect.live_bytes import LiveTensorBytes, state_bytes
from simplefsdp.inspect.shapes import model_shape
from simplefsdp.passes.aot_eager import BACKEND_NAME


def measured_peak(shape_name: str, choice: Choice, *, device: str) -> int:
    """This rank's parameter shards + optimizer state + the most tensor bytes alive during a
    forward + backward of `choice` (compiled op by op, after a first step that compiles and
    creates the optimizer state)."""
    torch.manual_seed(0)
    shape = model_shape(shape_name)
    model = shape.build(device="cpu")
    if choice.ac != "none":
        simplefsdp.checkpoint_blocks(model, policy=choice.ac)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    simplefsdp.wrap(
        model,
        mesh,
        strategy=choice.strategy,
        mp_policy=simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        passes=choice.passes(device=device),
        compile_regions=False,  # as the dry run traced it: every op in the step's graph, for LiveTensorBytes too
    )
    compiled = torch.compile(model, backend=BACKEND_NAME, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = shape.example_input(device="cpu")
    default_loss(compiled(tokens)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with LiveTensorBytes() as live:
        default_loss(compiled(tokens)).backward()
    return state_bytes(model, optimizer) + live.peak_bytes
