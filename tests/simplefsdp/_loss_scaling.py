"""Rank functions for the float16 loss-scaling tests (`test_loss_scaling.py`), eager, on 2 ranks.

`underflow`: a small MLP whose loss is multiplied by `TINY`, so that every gradient is below
float16's smallest subnormal (2^-24, rounding to zero below 2^-25) yet, times the scaler's initial
2^16, in float16's normal range: trained by SGD for `STEPS` steps in float32, under a float16 policy
without a scaler, and under the same policy with `simplefsdp.grad_scaler`. `inf_on_one_rank`: rank 1
alone finds an inf in its gradient shard; every rank must skip that step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import simplefsdp
from simplefsdp.models import Transformer, TransformerArgs, tensor_parallel_plan

TINY = 2.0**-22  # the loss's factor: largest gradient about 1.4e-8 < 2^-25, times 2^16 about 2^-10
STEPS = 3
LR = 2.0**18  # SGD: moves the parameters by about 1e-2 over the steps from gradients of about 1e-8


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    policy = None if dtype == torch.float32 else simplefsdp.MixedPrecisionPolicy(param_dtype=dtype)
    return simplefsdp.wrap(model, mp_policy=policy, passes=None)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def underflow(dtype: torch.dtype, *, scaled: bool) -> dict[str, list]:
    """The full (unscaled) gradients of each step and the parameters before and after, per parameter."""
    model = _mlp(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = simplefsdp.grad_scaler(model) if scaled else None
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    grads = []
    for step in range(STEPS):
        loss = model(_batch(step)).float().square().mean() * TINY
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "before": before, "after": [p.detach().full_tensor() for p in model.parameters()]}


def _tensor_parallel_model() -> tuple[nn.Module, list[nn.Parameter]]:
    """The built-in Transformer over dp 1 x tp 2, with its parameters ordered so that the first is a
    norm's weight, replicated over tp ([Note: the skip decision is reduced over every rank])."""
    torch.manual_seed(0)
    world = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    model = Transformer(TransformerArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_seq_len=8))
    parallelize_module(model, world["tp"], tensor_parallel_plan(model))
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.float16)
    simplefsdp.wrap(model, world["dp"], mp_policy=policy, passes=None)
    named = dict(model.named_parameters())
    first = named.pop("layers.0.attention_norm.weight")
    return model, [first, *named.values()]


def _mlp_model() -> tuple[nn.Module, list[nn.Parameter]]:
    model = _mlp(torch.float16)
    return model, list(model.parameters())


def inf_on_one_rank(mesh: str) -> dict[str, object]:
    """Two scaled steps: in the first, rank 1 puts an inf into its shard of one tp-sharded (or, on the
    1-D mesh, the last) gradient; the second is clean. Returns whether this rank's shards changed in
    each step and the scale after each."""
    model, params = _tensor_parallel_model() if mesh == "dp1xtp2" else _mlp_model()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = simplefsdp.grad_scaler(model)
    target = params[-1] if mesh == "1d" else next(p for p in params if p.placements[-1].is_shard())
    changed, scales = [], []
    for step in range(2):
        inputs = torch.randint(0, 32, (2, 8)) if mesh == "dp1xtp2" else _batch(step)
        loss = model(inputs).float().mean()
        scaler.scale(loss).backward()
        if step == 0 and dist.get_rank() == 1:
            with torch.no_grad():
                target.grad.to_local().view(-1)[0] = float("inf")
        before = [p.detach().to_local().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        changed.append(any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, params, strict=True)))
        scales.append(scaler.get_scale())
    return {"changed": changed, "scales": scales}
