"""`simplefsdp train --grad-clip`'s global gradient norm (`grad_norm.py`) equals torch's
`clip_grad_norm_` on the unsharded gradients: the norm it returns and the gradients it leaves.

One process (a world of 1 on the fake backend): DTensor gradients of 1-D and 2-D meshes with Shard
and Replicate placements, plain tensors and missing gradients, clipping and not. Two ranks of the
pool: the train model's real gradients under FULL_SHARD, HYBRID (the replicate dim holds copies),
tensor parallelism (tp-replicated weights beside tp-sharded ones) and offload (gradients in host
memory), against torch's function on the full gradients (`full_tensor()`).

Tolerance: float32 rounding (`assert_close`'s float32 default). torch sums the squares of
per-tensor norms, `grad_norm` the squares per shard and then over the ranks: the same terms added in
another order. A replicated copy counted twice is off by a factor up to sqrt(2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from simplefsdp._compat import init_fake_process_group
from simplefsdp.train.grad_norm import clip_grad_norm, grad_norm
from tests.train import _grad_norm_ranks


@pytest.fixture(scope="module")
def world1():
    init_fake_process_group(rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parameters() -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(sharded parameters with gradients, their unsharded twins with the same gradients)."""
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    mesh1 = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    layouts = [(mesh2, [Replicate(), Shard(0)]), (mesh2, [Shard(0), Shard(1)]), (mesh1, [Shard(0)]), (None, None)]
    ours, theirs = [], []
    for shape, (mesh, placements) in zip([(6, 4), (4, 8), (5,), (3, 3)], layouts, strict=True):
        grad = torch.randn(shape, generator=gen)

        def place(t, mesh=mesh, placements=placements):
            return t if mesh is None else distribute_tensor(t, mesh, placements)

        ours.append(nn.Parameter(place(torch.zeros(shape))))
        ours[-1].grad = place(grad.clone())
        theirs.append(nn.Parameter(torch.zeros(shape)))
        theirs[-1].grad = grad.clone()
    ours.append(nn.Parameter(torch.zeros(2)))  # no gradient: left out, as torch leaves it
    theirs.append(nn.Parameter(torch.zeros(2)))
    return ours, theirs


def _full(p: nn.Parameter) -> torch.Tensor:
    return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clips; leaves the gradients as they are
def test_clip_matches_torch_on_one_process(world1, max_norm):
    ours, theirs = _parameters()
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert (want > max_norm) == (max_norm == 0.5), "the cases must clip and not clip"
    got = clip_grad_norm(ours, max_norm=max_norm, device=torch.device("cpu"))
    torch.testing.assert_close(got, want)
    for mine, reference in zip(ours, theirs, strict=True):
        if reference.grad is None:
            assert mine.grad is None
        else:
            torch.testing.assert_close(_full(mine), reference.grad)


def test_norm_alone_leaves_the_gradients(world1):
    ours, theirs = _parameters()
    before = [_full(p).clone() for p in ours if p.grad is not None]
    norm = grad_norm(ours, device=torch.device("cpu"))
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None]))
    assert all(torch.equal(_full(p), b) for p, b in zip([p for p in ours if p.grad is not None], before, strict=True))


def test_a_partial_gradient_has_no_norm(world1):
    mesh = init_device_mesh("cpu", (1,))
    param = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(ValueError, match="holds unreduced sums"):
        grad_norm([param], device=torch.device("cpu"))


LAYOUTS = {
    "FULL_SHARD": {},
    "HYBRID_SHARD replicate 2": {"strategy": "HYBRID_SHARD", "shard_size": 1},
    "tp 2": {"tp": 2},
    "offload all": {"offload": "all"},
}


def test_clip_matches_torch_on_two_ranks(ranks2):
    per_rank = ranks2.run(_grad_norm_ranks.clip_layouts, LAYOUTS, 0.05)
    for name in LAYOUTS:
        for rank, result in enumerate(per_rank):
            got = result[name]
            assert got["want"] > 0.05, f"{name}: the test must clip"
            torch.testing.assert_close(got["norm"], got["want"], msg=lambda m, n=name, r=rank: f"{n}, rank {r}: {m}")
            for fqn, (mine, reference) in got["grads"].items():
                torch.testing.assert_close(mine, reference, msg=lambda m, n=name, f=fqn: f"{n} {f}: {m}")
    assert per_rank[0]["HYBRID_SHARD replicate 2"]["placements"] == ["(Replicate(), Shard(dim=0))"]
    assert any("Replicate" in p for p in per_rank[0]["tp 2"]["placements"]), "a tp-replicated weight"
    assert torch.equal(per_rank[0]["FULL_SHARD"]["norm"], per_rank[1]["FULL_SHARD"]["norm"]), "one norm on every rank"
