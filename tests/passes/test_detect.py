"""Detection of FSDP collectives in inductor's post-grad graphs, world 8 on the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import c10d_functional
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
N_PARAMS = len(list(Transformer(ARGS).parameters()))


def _post_grad(strategy: str, mp_policy=None):
    parsed = simplefsdp.ShardingStrategy.parse(strategy)
    mesh = init_device_mesh("cpu", (2, 4) if parsed.is_hybrid else (8,))
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy=parsed, mp_policy=mp_policy, passes=None)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    # inductor's post-grad graphs without its code generation (`simplefsdp_aot_eager`)
    return record_step(model, lambda compiled: compiled(tokens).float().sum(), backend="simplefsdp_aot_eager").post


@pytest.mark.slow  # every bucketing test in the fast tier detects first
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_finds_every_parameter_gather_and_gradient_reduction(fake_world8, strategy):
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    forward, backward = _post_grad(strategy, policy)

    gathers = find_fsdp_all_gathers(forward)
    assert len(gathers) == N_PARAMS
    assert len({g.source for g in gathers}) == N_PARAMS, "one gather per sharded parameter"
    assert {g.dtype for g in gathers} == {torch.bfloat16}, "seen through the bf16 cast"
    assert {g.group_size for g in gathers} == {4 if strategy == "HYBRID_SHARD" else 8}
    assert len(find_fsdp_all_gathers(backward)) == N_PARAMS - 1, "FULL_SHARD re-gathers (not the embedding)"

    reductions = find_fsdp_reductions(backward)
    kinds = [r.kind for r in reductions]
    assert kinds.count("reduce_scatter") == N_PARAMS
    assert kinds.count("all_reduce") == (N_PARAMS if strategy == "HYBRID_SHARD" else 0)
    assert {r.dtype for r in reductions} == {torch.float32}
    assert {r.reduce_op for r in reductions} == {"avg"}
    assert find_fsdp_reductions(forward) == []


@pytest.mark.slow
def test_no_shard_has_only_all_reduces(fake_world8):
    forward, backward = _post_grad("NO_SHARD")
    assert find_fsdp_all_gathers(forward) == []
    assert [r.kind for r in find_fsdp_reductions(backward)] == ["all_reduce"] * N_PARAMS


def test_ignores_collectives_that_are_not_fsdp(fake_world8):
    """An all-gather of an activation and an all-reduce whose result is consumed by compute are left alone."""

    class UserCollectives(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            group = dist.group.WORLD
            gathered = c10d_functional.all_gather_into_tensor(self.linear(x), 8, group.group_name)
            gathered = c10d_functional.wait_tensor(gathered)
            reduced = c10d_functional.all_reduce(gathered.sum(0), "sum", group.group_name)
            return c10d_functional.wait_tensor(reduced).relu()

    x = torch.randn(2, 4, requires_grad=True)
    forward, _ = record_step(UserCollectives(), lambda compiled: compiled(x).sum()).post
    assert collective_counts(forward)["all_gather"] == 1
    assert find_fsdp_all_gathers(forward) == []
    assert find_fsdp_reductions(forward) == []
