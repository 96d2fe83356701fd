"""Quantized parameter all-gathers (`MixedPrecisionPolicy(gather_dtype=...)`): the traced graph, the
straight-through gradients, and what stays full precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import simplefsdp
from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.record import record_step
from simplefsdp.kernels import quantize
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts, derives_from_all_gather, find_collectives
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig

AOT_EAGER = "simplefsdp_aot_eager"  # post-grad graphs with our pass, no code generation
ARGS = TransformerArgs(vocab_size=96, dim=128, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=16)
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _policy(gather_dtype: str | None, **kw) -> simplefsdp.MixedPrecisionPolicy:
    return simplefsdp.MixedPrecisionPolicy(**BF16, gather_dtype=gather_dtype, **kw)


def _recorded(gather_dtype: str | None, strategy: str = "FULL_SHARD"):
    mesh = init_device_mesh("cpu", (2, 4) if "HYBRID" in strategy else (8,))
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy=strategy, passes=None, mp_policy=_policy(gather_dtype))
    config = PassConfig(bucket=BucketConfig(blocks=tuple(find_repeated_blocks(Transformer(ARGS)))))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    return record_step(
        model, lambda compiled: compiled(tokens).float().sum(), graph_pass=FsdpPass(config), backend=AOT_EAGER
    ).post


def _gathered_bytes(graph) -> int:
    return sum(c.nbytes for c in find_collectives(graph, kinds=("all_gather",)))


def test_graph_gathers_bytes_bucketed_per_block(fake_world8):
    """int8 codes + fp32 scales travel as uint8, one bucket per block as in bf16 (forward L + 2, backward's
    re-gathers L + 1), at most 0.55x bf16's bytes; the gradients reduce in fp32 as before; the forward
    saves no gathered weight for backward (FULL_SHARD reshards)."""
    quant_fwd, quant_bwd = _recorded("int8")
    plain_fwd, plain_bwd = _recorded(None)
    for quant, plain in ((quant_fwd, plain_fwd), (quant_bwd, plain_bwd)):
        assert collective_counts(quant) == collective_counts(plain)
        gathers = find_collectives(quant, kinds=("all_gather",))
        assert gathers
        assert all(c.dtype == torch.uint8 for c in gathers)
        assert _gathered_bytes(quant) <= 0.55 * _gathered_bytes(plain)
    assert collective_counts(quant_fwd)["all_gather"] == ARGS.n_layers + 2
    reductions = find_collectives(quant_bwd, kinds=("reduce_scatter",))
    assert reductions
    assert all(c.dtype == torch.float32 for c in reductions)
    saved = [n for n in quant_fwd.find_nodes(op="output")[0].all_input_nodes if derives_from_all_gather(n)]
    assert not saved


@pytest.mark.slow
def test_tensor_parallel_gathers_quantize_over_dp_only(fake_world8):
    """dp 4 x tp 2: the parameter gathers over dp travel as uint8 codes; tensor parallelism's own
    collectives (activations, over tp) keep their dtypes; the gradients reduce over dp in fp32."""
    from torch.distributed.tensor.parallel import parallelize_module

    from simplefsdp.models import tensor_parallel_plan
    from simplefsdp.passes.collectives import group_ranks

    world = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer(ARGS)
    parallelize_module(model, world["tp"], tensor_parallel_plan(model))
    simplefsdp.wrap(model, world["dp"], mp_policy=_policy("int8"))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    forward, backward = record_step(model, lambda compiled: compiled(tokens).float().sum(), backend=AOT_EAGER).post
    dp = tuple(range(0, 8, 2))  # rank 0's dp group: every other rank
    for graph in (forward, backward):
        gathers = find_collectives(graph, kinds=("all_gather",))
        dp_gathers = [c for c in gathers if group_ranks(c.group_name) == dp]
        assert dp_gathers
        assert all(c.dtype == torch.uint8 for c in dp_gathers)
        assert all(c.dtype != torch.uint8 for c in gathers if c not in dp_gathers)
    reductions = [c for c in find_collectives(backward, kinds=("reduce_scatter",)) if group_ranks(c.group_name) == dp]
    assert reductions
    assert all(c.dtype == torch.float32 for c in reductions)


# --- on 2 gloo ranks ------------------------------------------------------------------------------


def _dequantized_master(param, code_dtype: torch.dtype, block: int, world: int) -> torch.Tensor:
    """The fp32 value every rank dequantizes `param` (Shard(0) over `world`) to, from `quantize.py`."""
    full = param.full_tensor().float()
    rows = math.ceil(full.shape[0] / world)
    shards = [full[r * rows : (r + 1) * rows] for r in range(world)]
    chunk = rows * math.prod(full.shape[1:])
    gathered = torch.cat([quantize.quantize_slot([s], [chunk], code_dtype, block) for s in shards])
    return quantize.dequantize_gathered(gathered, [chunk], [full.numel()], world, code_dtype, block, torch.float32)[
        0
    ].view(full.shape)


def _step(model, tokens, *, accumulate: bool = False) -> tuple[float, list[torch.Tensor]]:
    compiled = torch.compile(model, backend=AOT_EAGER)
    if accumulate:  # a micro-batch under no_sync first: its sum joins the next backward's reduction
        with simplefsdp.no_sync(model):
            compiled(tokens.flip(0)).float().pow(2).mean().backward()
    loss = compiled(tokens).float().pow(2).mean()
    loss.backward()
    return loss.item(), [p.grad.to_local().clone() for p in model.parameters()]


def _straight_through(gather_dtype: str, strategy: str, *, tie: bool, checkpoint: bool, offload: bool) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2) if "HYBRID" in strategy else (world,))
    args = dataclasses.replace(ARGS, tie_embeddings=tie)
    code_dtype = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}[gather_dtype]
    models = []
    for policy in (_policy(gather_dtype), _policy(None)):
        torch.manual_seed(0)
        model = Transformer(args)
        if checkpoint:
            simplefsdp.checkpoint_blocks(model)
        offloaded = simplefsdp.OffloadPolicy() if offload else None
        models.append(simplefsdp.wrap(model, mesh, strategy=strategy, mp_policy=policy, offload=offloaded))
    quantized, reference = models
    shard_world = mesh.size(mesh.ndim - 1)
    with torch.no_grad():  # the reference's masters: the quantized model's dequantized weights
        for q, r in zip(quantized.parameters(), reference.parameters(), strict=True):
            value = _dequantized_master(q, code_dtype, 128, shard_world)
            r.to_local().copy_(distribute_tensor(value, r.device_mesh, r.placements).to_local())
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    wq = quantized.layers[0].attention.wq
    master = wq._parameters["weight"].full_tensor()
    q_loss, q_grads = _step(quantized, tokens, accumulate=offload)
    r_loss, r_grads = _step(reference, tokens, accumulate=offload)
    eager_weight = wq.weight  # outside the compiled step: the master in param_dtype, not its quantized image
    return {
        "losses": (q_loss, r_loss),
        "grads_equal": [torch.equal(a, b) for a, b in zip(q_grads, r_grads, strict=True)],
        "grad_dtypes": {str(g.dtype) for g in q_grads},
        "eager_weight_exact": torch.equal(eager_weight, master.to(torch.bfloat16)),
        "eager_weight_not_quantized": not torch.equal(
            eager_weight,
            _dequantized_master(wq._parameters["weight"], code_dtype, 128, shard_world).to(torch.bfloat16),
        ),
    }


def _check_straight_through(results: list[dict]) -> None:
    for result in results:
        q_loss, r_loss = result["losses"]
        assert q_loss == r_loss
        assert all(result["grads_equal"]), result["grads_equal"]
        assert result["grad_dtypes"] == {"torch.float32"}
        assert result["eager_weight_exact"]
        assert result["eager_weight_not_quantized"]


@pytest.mark.slow
def test_gradients_are_the_unquantized_gathers_at_the_dequantized_weights(ranks4):
    """int8 on a 2 x 2 HYBRID mesh (all-reduce over replicas, reduce-scatter within; re-gathered in
    backward), the output head tied to the embedding, every block activation-checkpointed, the
    parameters offloaded to host memory, a `no_sync` micro-batch before the step: the loss and every
    gradient are bitwise those of bf16 gathers of the dequantized weights."""
    results = ranks4.run(_straight_through, "int8", "HYBRID_SHARD", tie=True, checkpoint=True, offload=True)
    _check_straight_through(results)


# --- convergence on the embedded corpus -------------------------------------------------------------

CONVERGENCE_STEPS = 300


def _train_losses(gather_dtype: str | None) -> list[float]:
    """Per-step losses of a one-block Llama on the embedded corpus, 2 ranks, bf16 compute and fp32
    reductions, gathers quantized to `gather_dtype` or not; same seeds for every `gather_dtype`."""
    from simplefsdp.train.data import VOCAB, TokenBatches

    args = TransformerArgs(vocab_size=len(VOCAB), dim=64, n_layers=1, n_heads=4, ffn_dim=172, max_seq_len=16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(args), mesh, mp_policy=_policy(gather_dtype))
    compiled = torch.compile(model, backend=AOT_EAGER)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = TokenBatches(seq_len=16, batch_per_rank=4, dp_rank=dist.get_rank(), dp_size=2, seed=0)
    losses = []
    for _, batch in zip(range(CONVERGENCE_STEPS), batches, strict=False):
        logits = compiled(batch[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged = loss.detach().clone()
        dist.all_reduce(averaged)
        losses.append(averaged.item() / 2)
    return losses


@pytest.mark.slow
def test_int8_gathers_converge_like_bf16_gathers(ranks2):
    """Averaged over steps 250-300, the loss with int8 gathers is within 2% of bf16 gathers'."""
    plain = ranks2.run(_train_losses, None)[0]
    int8 = ranks2.run(_train_losses, "int8")[0]
    window = slice(250, CONVERGENCE_STEPS)
    plain_tail, int8_tail = sum(plain[window]) / 50, sum(int8[window]) / 50
    assert plain_tail < 0.6 * plain[0], "the run learns (else the comparison means nothing)"
    assert abs(int8_tail - plain_tail) <= 0.02 * plain_tail, (plain_tail, int8_tail)
    assert int8 != plain, "the int8 run gathered other values"
