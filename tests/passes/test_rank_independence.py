"""Every rank issues the same collectives in the same order after the pass (a mismatch is a hang).

Two processes play rank 0 and the last rank of a fake world of 8 (FULL_SHARD over 8, or HYBRID_SHARD
over 2 x 4). The vocabulary (67 rows) shards unevenly: over 8, ranks 0-6 hold 9 rows of the embedding
and the output head and rank 7 holds 4, padded to 9 before gathering; so the ranks' graphs differ
before the pass. After it, the sequence of launches and waits must be identical: kind, group
(numbered by first appearance, since a rank's own subgroups have their own names), dtype, size, and
which launch each wait completes.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import fake_store
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import is_all_gather, is_all_reduce, is_reduce_scatter, is_wait
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.plan import find_repeated_blocks
from tests._graphs import capture_post_grad

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=3, n_heads=4, ffn_dim=88, max_seq_len=16)
WORLD = 8


def _sequence(graph: fx.Graph) -> list[tuple]:
    """The graph's collectives in program order, with everything that must agree across ranks."""
    launches: dict[str, int] = {}
    groups: dict[str, int] = {}  # a rank's own subgroups have their own names: compare by first appearance
    sequence = []
    for node in graph.nodes:
        if is_wait(node):
            sequence.append(("wait", launches[node.args[0].name]))
        elif is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node):
            launches[node.name] = len(launches)
            val = node.meta["val"]
            group = groups.setdefault(node.kwargs.get("group_name", node.args[-1]), len(groups))
            sequence.append((node.target.name(), group, val.dtype, val.numel(), tuple(val.shape)))
    return sequence


def _input_shapes(graph: fx.Graph) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in graph.find_nodes(op="placeholder")]


def _as_rank(rank: int, strategy: str) -> tuple[list, list[list[tuple]], int, int, str]:
    """In a fresh process (torch caches DTensor specs, process-group names included, across
    re-initialisations): this rank's forward input shapes, collective sequences, merged, moved and
    the pass's cache key."""
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=WORLD)
    try:
        parsed = simplefsdp.ShardingStrategy.parse(strategy)
        mesh = init_device_mesh("cpu", (2, 4) if parsed.is_hybrid else (WORLD,))
        torch.manual_seed(0)
        model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy=parsed, passes=None)
        graph_pass = FsdpPass(PassConfig(bucket=BucketConfig(blocks=tuple(find_repeated_blocks(model)))))
        tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
        graphs = capture_post_grad(model, lambda compiled: compiled(tokens).sum(), before=graph_pass)
        sequences = [_sequence(g) for g in graphs]
        return _input_shapes(graphs[0]), sequences, graph_pass.merged, graph_pass.moved, graph_pass.uuid()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_first_and_last_rank_issue_the_same_collectives(strategy):
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        first, last = pool.map(_as_rank, [0, WORLD - 1], [strategy] * 2)
    assert first[0] != last[0], "the two ranks hold different shard shapes (the case this test is for)"
    assert first[2] > 0, "the pass bucketed"
    assert first[3] > 0, "the pass reordered"
    assert first[4] != last[4], "the graphs hold each rank's slot offset: [Note: the rank is part of the cache key]"
    for kind, seq_first, seq_last in zip(("forward", "backward"), first[1], last[1], strict=True):
        assert len(seq_first) > 4, f"{kind}: the graph has collectives"
        assert seq_first == seq_last, f"{kind}: rank 0 and rank {WORLD - 1} issue different collectives"
