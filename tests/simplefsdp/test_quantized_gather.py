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


def _step(model, tokens) -> tuple[float, list[torch.Tensor]]:
    compiled = torch.compile(model, backend=AOT_EAGER)
    loss = compiled(tokens).float().pow(2).mean()
    loss.backward()
    return loss.item(), [p.grad.to_local().clone() for p in model.parameters()]


def _straight_through(gather_dtype: str, strategy: str, tie: bool) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2) if "HYBRID" in strategy else (world,))
    args = dataclasses.replace(ARGS, tie_embeddings=tie)
    code_dtype = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}[gather_dtype]
    torch.manual_seed(0)
    quantized = simplefsdp.wrap(Transformer(args), mesh, strategy=strategy, mp_policy=_policy(gather_dtype))
    torch.manual_seed(0)
    reference = simplefsdp.wrap(Transformer(args), mesh, strategy=strategy, mp_policy=_policy(None))
    shard_world = mesh.size(mesh.ndim - 1)
    with torch.no_grad():  # the reference's masters: the quantized model's dequantized weights
        for q, r in zip(quantized.parameters(), reference.parameters(), strict=True):
            value = _dequantized_master(q, code_dtype, 128, shard_world)
            r.to_local().copy_(distribute_tensor(value, r.device_mesh, r.placements).to_local())
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    before = [p.full_tensor().clone() for p in quantized.parameters()]
    q_loss, q_grads = _step(quantized, tokens)
    r_loss, r_grads = _step(reference, tokens)
    # outside the compiled step a gather is the master in param_dtype, not its quantized image
    weight = quantized.layers[0].attention.wq.weight
    master = before[[n for n, _ in quantized.named_parameters()].index("layers.0.attention.wq.weight")]
    return {
        "losses": (q_loss, r_loss),
        "grads_equal": [torch.equal(a, b) for a, b in zip(q_grads, r_grads, strict=True)],
        "grad_dtypes": {str(g.dtype) for g in q_grads},
        "eager_weight_exact": torch.equal(weight, master.to(torch.bfloat16)),
        "eager_weight_not_quantized": not torch.equal(
            weight,
            _dequantized_master(
                quantized.layers[0].attention.wq._parameters["weight"], code_dtype, 128, shard_world
            ).to(torch.bfloat16),
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gather_dtype", "strategy", "tie"),
    [("int8", "FULL_SHARD", False), ("float8_e4m3fn", "SHARD_GRAD_OP", True)],
)
def test_gradients_are_the_unquantized_gathers_at_the_dequantized_weights(ranks2, gather_dtype, strategy, tie):
    for result in ranks2.run(_straight_through, gather_dtype, strategy, tie):
        q_loss, r_loss = result["losses"]
        assert q_loss == r_loss
        assert all(result["grads_equal"]), result["grads_equal"]
        assert result["grad_dtypes"] == {"torch.float32"}
        assert result["eager_weight_exact"]
        assert result["eager_weight_not_quantized"]
