"""Models and rank functions for the composition tests: tied, frozen and mixed-dtype parameters, clipping.

The test model is the reference transformer with its output head tied to the embedding, and LoRA
adapters on every block's `wq` and `wv`: the base projection frozen and stored in bf16 (cast up
on use), the two adapter matrices trainable in fp32. So one model holds a tied parameter, frozen
and trainable parameters in the same block, and two parameter dtypes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp.models import Transformer
from simplefsdp.passes.install import pass_of
from tests.simplefsdp import _training as training

TIED = dataclasses.replace(training.ARGS, tie_embeddings=True)
LORA_RANK = 4


class LoRALinear(nn.Module):
    """`base(x) + x A^T B^T`: `base` frozen (in `base_dtype`, cast to the input's dtype on use), A and B trained."""

    def __init__(self, base: nn.Linear, *, rank: int, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base.to(base_dtype).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.02)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.base.weight.to(x.dtype)) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def lora_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TIED)
    for layer in model.layers:
        layer.attention.wq = LoRALinear(layer.attention.wq, rank=LORA_RANK, base_dtype=torch.bfloat16)
        layer.attention.wv = LoRALinear(layer.attention.wv, rank=LORA_RANK, base_dtype=torch.bfloat16)
    return model


def frozen_fqns(model: nn.Module) -> set[str]:
    return {fqn for fqn, p in model.named_parameters() if not p.requires_grad}


@dataclasses.dataclass(frozen=True)
class LoraResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    frozen_grads: list[str]  # frozen parameters that got a gradient (must be none)
    tied_is_one_parameter: bool
    dtypes: dict[str, torch.dtype]


def _train(model: nn.Module, step_fn: nn.Module, *, shard: bool) -> tuple[list[float], list[str]]:
    # SGD: updates linear in the gradients, so the parameters differ from the reference only by the
    # gradients' few-ulp summation-order differences (AdamW divides by sqrt(v) and can magnify an
    # almost-zero gradient's rounding)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    rank, world = (dist.get_rank(), dist.get_world_size()) if shard else (0, 1)
    losses, frozen_grads = [], []
    for tokens in training.batches():
        loss = training.loss_fn(step_fn, tokens.chunk(world)[rank])
        loss.backward()
        frozen_grads += [fqn for fqn, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if shard:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, frozen_grads


def _result(model: nn.Module, losses: list[float], frozen_grads: list[str]) -> LoraResult:
    return LoraResult(
        losses=losses,
        params=training.full_params(model),
        frozen_grads=frozen_grads,
        tied_is_one_parameter=model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"],
        dtypes={fqn: p.dtype for fqn, p in model.named_parameters()},
    )


def train_lora_reference() -> LoraResult:
    model = lora_model()
    return _result(model, *_train(model, model, shard=False))


def train_lora_simplefsdp(backend: str) -> LoraResult:
    model = simplefsdp.wrap(lora_model())
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    return _result(model, *_train(model, step_fn, shard=True))


def clip_once(backend: str, max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """One backward on this rank's half batch, then `clip_grad_norm_`: (returned norm, full clipped grads)."""
    model = training.fresh_model()
    if backend != "reference":
        simplefsdp.wrap(model)
    step_fn = model if backend in ("eager", "reference") else torch.compile(model, backend=backend)
    tokens = training.batches(1)[0]
    if backend != "reference":
        tokens = tokens.chunk(dist.get_world_size())[dist.get_rank()]
    training.loss_fn(step_fn, tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    grads = {
        fqn: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for fqn, p in model.named_parameters()
    }
    return norm.item(), grads


MICRO_BATCHES = 2


def train_accumulating(backend: str, *, accumulate: bool):
    """FULL_SHARD, this rank's half of each global batch; with `accumulate`, as `MICRO_BATCHES`
    micro-batches (all but the last inside `no_sync`), each loss scaled by 1 / MICRO_BATCHES.
    Returns (losses, full parameters, graphs compiled so far after each step, gradients left
    pending by each step's no_sync block)."""
    model = simplefsdp.wrap(training.fresh_model())
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, compiled, deferred = [], [], []
    for tokens in training.batches():
        local = tokens.chunk(dist.get_world_size())[dist.get_rank()]
        parts = local.chunk(MICRO_BATCHES) if accumulate else [local]
        total = 0.0
        for i, part in enumerate(parts):
            with simplefsdp.no_sync(model, enabled=i < len(parts) - 1):
                loss = training.loss_fn(step_fn, part) / len(parts)
                loss.backward()
            if i == 0 and accumulate:
                deferred.append(len(model._simplefsdp_accumulation.pending))
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        graph_pass = pass_of(model)
        compiled.append(graph_pass.graphs if graph_pass else 0)
    return losses, training.full_params(model), compiled, deferred


def meta_materialize(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, int], int, torch.Tensor]:
    """Build on meta, wrap, materialize: (full parameters, local elements per parameter, peak
    temporary bytes, logits of the first batch)."""
    with torch.device("meta"):
        model = Transformer(training.ARGS)
    simplefsdp.wrap(model)
    torch.manual_seed(seed)
    peak = simplefsdp.materialize(model)
    local = {fqn: p.to_local().numel() for fqn, p in model.named_parameters()}
    tokens = training.batches(1)[0]
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    # accumulation works on the materialized model: the same batch twice, the first deferred
    training.loss_fn(model, tokens).backward()
    once = {fqn: p.grad.full_tensor() for fqn, p in model.named_parameters()}
    model.zero_grad()
    with simplefsdp.no_sync(model):
        training.loss_fn(model, tokens).backward()
    training.loss_fn(model, tokens).backward()
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), 2 * once[fqn], msg=fqn)
    return training.full_params(model), local, peak, logits


def train_checkpointed(backend: str, policy: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """FULL_SHARD, every block checkpointed with `policy` (None: one process, no checkpointing, the
    reference), SGD: (losses, full parameters)."""
    model = training.fresh_model()
    if policy is None:
        losses, _ = _train(model, model, shard=False)
        return losses, training.full_params(model)
    simplefsdp.checkpoint_blocks(model, policy=policy)
    simplefsdp.wrap(model)
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    losses, _ = _train(model, step_fn, shard=True)
    return losses, training.full_params(model)
