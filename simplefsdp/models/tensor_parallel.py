"""The tensor-parallel plan of the reference `Transformer`, for torch's `parallelize_module`.

Megatron-style: in each block the q/k/v and w1/w3 projections are column-parallel (each tp rank
computes H / tp heads and ffn / tp hidden units), wo and w2 row-parallel; with `sequence_parallel`
the norms and the residual stream are sharded along the sequence between blocks (SequenceParallel)
and the embedding's output and the head's input are sequence-sharded too.

    tp_mesh = world["tp"]
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel=True))
    simplefsdp.wrap(model, world["dp"])
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from simplefsdp.models.llama import Transformer

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan(model: Transformer, *, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """FQN -> parallel style for every parallelized submodule of `model` (heads and ffn must divide by tp)."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        plan |= {
            f"{block}.attention": PrepareModuleInput(
                input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
            ),
            f"{block}.attention.wq": ColwiseParallel(),
            f"{block}.attention.wk": ColwiseParallel(),
            f"{block}.attention.wv": ColwiseParallel(),
            f"{block}.attention.wo": RowwiseParallel(output_layouts=between),
            f"{block}.feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            f"{block}.feed_forward.w1": ColwiseParallel(),
            f"{block}.feed_forward.w3": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan |= {f"{block}.attention_norm": SequenceParallel(), f"{block}.ffn_norm": SequenceParallel()}
    return plan
