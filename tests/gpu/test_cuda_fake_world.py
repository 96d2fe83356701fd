"""A compiled training step on CUDA at world 8, on torch's fake process group (one GPU plays rank 0).

Mirrors `tests/simplefsdp/test_graphs.py` and `tests/passes/test_bucketing.py` (the same step traced
on the CPU): here inductor compiles it for the GPU, the bucketed graph's copies run the Triton kernel
and the merged all-gather runs on CUDA tensors. The fake group moves no data,
so the values are not checked here (`test_cuda_nccl.py` does, at world 1), only that the step runs
end to end and what its graphs hold.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import c10d_functional
from simplefsdp.inspect.record import record_step
from simplefsdp.kernels import copy_ops
from simplefsdp.models import Transformer, TransformerArgs
from tests.gpu import CUDA_ONLY

pytestmark = CUDA_ONLY

ARGS = TransformerArgs(vocab_size=1024, dim=256, n_layers=2, n_heads=4, ffn_dim=704, max_seq_len=64)


def _targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_compiled_step_on_cuda_world8_runs_the_bucketed_kernels(fake_world8, monkeypatch):
    from simplefsdp.kernels import triton_copy

    copy_ops._kernel_choice.cache_clear()
    launches = []
    launch = triton_copy.launch_bucket
    monkeypatch.setattr(
        triton_copy, "launch_bucket", lambda plan, *a, **k: launches.append(plan) or launch(plan, *a, **k)
    )
    mesh = init_device_mesh("cuda", (8,))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(ARGS)
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    simplefsdp.wrap(model, mesh, mp_policy=policy)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), device="cuda")
    graphs = record_step(model, lambda compiled: compiled(tokens).float().sum(), backend="inductor")
    torch.cuda.synchronize()

    forward, backward = _targets(graphs.forward), _targets(graphs.backward)
    assert copy_ops.ALL_GATHER_COPY_IN in forward
    assert c10d_functional.all_gather_into_tensor.default in forward
    assert copy_ops.ALL_GATHER_COPY_OUT in forward
    assert copy_ops.REDUCE_SCATTER_COPY_IN in backward
    assert launches, "the copies ran the Triton kernel"
    for fqn, p in model.named_parameters():
        assert p.grad is not None, fqn
        assert p.grad.to_local().is_cuda, fqn
        assert p.grad.to_local().shape == p.to_local().shape, fqn
    copy_ops._kernel_choice.cache_clear()
