"""One compiled graph for every rank where the ranks' graphs are the same: [Note: no rank in the graph]
(passes/bucket.py), [Note: the rank is not part of the cache key] (passes/fsdp_pass.py) and
[Note: per-rank AOTAutograd cache keys for DTensor inputs] (simplefsdp/_compat.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import simplefsdp
from simplefsdp._compat import c10d_functional, init_fake_process_group, rank_aware_cache_key
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig

EVEN = TransformerArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)  # 2 ranks divide all
UNEVEN = dataclasses.replace(EVEN, vocab_size=67)  # the embedding and output: 34 rows on rank 0, 33 on rank 1
ONE_BUCKET = PassConfig(bucket=BucketConfig(plan="cap", cap_bytes=2**30))


def _text(graph: fx.Graph) -> str:
    """Every node with its arguments and its value's shape and dtype: two graphs with equal texts
    compile to the same code."""

    def meta(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"{value.dtype}{list(value.shape)}{list(value.stride())}"
        if isinstance(value, (list, tuple)):
            return "(" + ", ".join(map(meta, value)) + ")"
        return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__

    return "\n".join(f"{node.format_node()}  # {meta(node.meta.get('val'))}" for node in graph.nodes)


def _step_after_the_pass(args: TransformerArgs) -> dict:
    """On each gloo rank: the pass's forward and backward graphs, its cache key, and the AOTAutograd
    keys of the parameters."""
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(args), init_device_mesh("cpu", (dist.get_world_size(),)), passes=None)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    graph_pass = FsdpPass(ONE_BUCKET)
    graphs = record_step(
        model, lambda compiled: compiled(tokens).sum(), graph_pass=graph_pass, backend="simplefsdp_aot_eager"
    )
    targets = {str(n.target) for g in graphs.post for n in g.nodes}
    return {
        "graphs": [_text(graphs.forward), _text(graphs.backward)],
        "uuid": graph_pass.uuid(),
        "keys": {fqn: rank_aware_cache_key(p, "torch's key") for fqn, p in model.named_parameters()},
        "targets": targets,
    }


def test_even_shards_give_every_rank_one_graph_and_one_key(ranks2):
    ranks = ranks2.run(_step_after_the_pass, EVEN)
    assert ranks[0]["graphs"] == ranks[1]["graphs"], "the ranks' post-pass graphs differ"
    assert ranks[0]["uuid"] == ranks[1]["uuid"]
    assert ranks[0]["keys"] == ranks[1]["keys"]
    # the graphs hold the merged buckets (not a graph the pass left alone): the out-of-place gather,
    # and gloo's in-place all-reduce with the slot copy that finds the rank when it runs
    targets = ranks[0]["targets"]
    for op in (
        torch.ops.simplefsdp.all_gather_copy_in.default,
        c10d_functional.all_gather_into_tensor.default,
        c10d_functional.all_reduce_.default,
        torch.ops.simplefsdp.rank_slot.default,
    ):
        assert str(op) in targets, op
    assert str(c10d_functional.all_gather_into_tensor_out.default) not in targets


@pytest.mark.slow  # a second compile on both ranks; the key's rule is checked cheaply below
def test_uneven_shards_keep_per_rank_graphs_and_keys(ranks2):
    ranks = ranks2.run(_step_after_the_pass, UNEVEN)
    assert ranks[0]["graphs"][0] != ranks[1]["graphs"][0], "a rank's local shape is in its graph"
    assert ranks[0]["uuid"] == ranks[1]["uuid"], "the pass's key holds no rank: the graphs tell them apart"
    differ = {fqn for fqn, key in ranks[0]["keys"].items() if key != ranks[1]["keys"][fqn]}
    assert differ == {"tok_embeddings.weight", "output.weight"}, differ


def _local_rows(rows: int, size: int, coordinate: int) -> int:
    chunk = math.ceil(rows / size)
    return max(0, min(chunk, rows - coordinate * chunk))


def _key_on_rank(rank: int, world: int, mesh_shape: tuple[int, ...], rows: int) -> str:
    """The rank-aware key of a `[rows, 3]` tensor sharded on dim 0 over the last mesh dim (replicated
    over any other), as rank `rank` of a fake world computes it."""
    init_fake_process_group(rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        coordinate = mesh.get_coordinate()[-1]
        local = torch.zeros(_local_rows(rows, mesh_shape[-1], coordinate), 3)
        placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]
        dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=(rows, 3), stride=(3, 1))
        return rank_aware_cache_key(dtensor, "torch's key")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("mesh_shape", "rows", "shared"),
    [
        ((4,), 8, True),  # even, 1-D: one key
        ((4,), 5, False),  # uneven: ranks 0 and 1 hold 2 rows each, and still get keys of their own
        ((2, 2), 8, False),  # 2-D (HYBRID's layout): per rank, though every shard holds 4 rows
    ],
)
def test_the_key_holds_the_mesh_coordinate_only_where_graphs_can_differ(mesh_shape, rows, shared):
    world = math.prod(mesh_shape)
    keys = [_key_on_rank(rank, world, mesh_shape, rows) for rank in (0, 1)]
    assert (keys[0] == keys[1]) is shared, keys
