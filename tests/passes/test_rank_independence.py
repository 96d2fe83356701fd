"""Every rank issues the same collectives in the same order after the pass (a mismatch is a hang).

Two processes play rank 0 and the last rank of a fake world. The vocabulary (67 rows) shards
unevenly: over 8 ranks, ranks 0-6 hold 9 rows of the embedding and the output head and rank 7
holds 4, padded to 9 before gathering; over 64, ranks 34-63 hold none. So the ranks' graphs differ
before the pass. After it, the sequence of launches and waits must be identical: kind, group
(numbered by first appearance, since a rank's own subgroups have their own names), dtype, size, and
which launch each wait completes. For the cost-model plan, the compute seconds it plans with must
be identical too: a near-tie decided differently on two ranks would bucket differently.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import init_fake_process_group
from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes import cost
from simplefsdp.passes.collectives import is_wait, parse_collective
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=3, n_heads=4, ffn_dim=88, max_seq_len=16)
WIDE = dataclasses.replace(ARGS, dim=64, ffn_dim=128)  # world 64: only the vocabulary uneven (compiles fast)


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    strategy: str
    plan: str  # "blocks" (the default) or "auto"

    @property
    def args(self) -> TransformerArgs:
        return ARGS if self.world < 64 else WIDE


CASES = [
    Case(8, "FULL_SHARD", "blocks"),
    Case(8, "HYBRID_SHARD", "blocks"),
    Case(8, "FULL_SHARD", "auto"),
    Case(64, "FULL_SHARD", "blocks"),  # the last rank holds no vocabulary rows at all
]


def _sequence(graph: fx.Graph) -> list[tuple]:
    """The graph's collectives in program order, with everything that must agree across ranks."""
    launches: dict[str, int] = {}
    groups: dict[str, int] = {}  # a rank's own subgroups have their own names: compare by first appearance
    sequence = []
    for node in graph.nodes:
        if is_wait(node):
            sequence.append(("wait", launches[node.args[0].name]))
        elif (collective := parse_collective(node)) is not None:
            launches[node.name] = len(launches)
            val = node.meta["val"]
            group = groups.setdefault(collective.group_name, len(groups))
            sequence.append((node.target.name(), group, val.dtype, val.numel(), tuple(val.shape)))
    return sequence


def _input_shapes(graph: fx.Graph) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in graph.find_nodes(op="placeholder")]


def _windows(graph: fx.Graph) -> list[list[float]]:
    """The cost model's compute windows around the FSDP collectives of a graph before the pass
    (what the auto plan decides with)."""
    device = cost.profile("h100")
    found = [find_fsdp_all_gathers(graph), find_fsdp_reductions(graph)]
    return [cost.compute_between(device, graph, [c.launch for c in f]) for f in found if f]


@dataclasses.dataclass
class RankResult:
    input_shapes: list[tuple[int, ...]]
    sequences: list[list[tuple]]
    windows: list[list[float]]
    merged: int
    moved: int
    reorders: list[tuple]  # per graph: (budgets, peak before, peak after) of the reordering
    cache_key: str


def _as_rank(rank: int, case: Case) -> RankResult:
    """In a fresh process (torch caches DTensor specs, process-group names included, across
    re-initialisations): what rank `rank` of `case` traces and the pass makes of it."""
    init_fake_process_group(rank=rank, world_size=case.world)
    try:
        parsed = simplefsdp.ShardingStrategy.parse(case.strategy)
        mesh = init_device_mesh("cpu", (2, case.world // 2) if parsed.is_hybrid else (case.world,))
        torch.manual_seed(0)
        model = simplefsdp.wrap(Transformer(case.args), mesh, strategy=parsed, passes=None)
        blocks = tuple(find_repeated_blocks(model))
        bucket = BucketConfig(blocks=blocks) if case.plan == "blocks" else BucketConfig(plan="auto", device="h100")
        graph_pass = FsdpPass(PassConfig(bucket=bucket))
        tokens = torch.randint(0, case.args.vocab_size, (2, 8))
        # inductor's post-grad graphs, the pass's output, without its code generation
        graphs = record_step(
            model, lambda compiled: compiled(tokens).sum(), graph_pass=graph_pass, backend="simplefsdp_aot_eager"
        )
        return RankResult(
            input_shapes=_input_shapes(graphs.forward),
            sequences=[_sequence(g) for g in graphs.post],
            windows=[w for g in graphs.pre for w in _windows(g)],
            merged=graph_pass.merged,
            moved=graph_pass.moved,
            reorders=[(r.budgets, r.peak_before, r.peak_after) for r in graph_pass.reorders],
            cache_key=graph_pass.uuid(),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.strategy}-world{c.world}-{c.plan}")
def test_first_and_last_rank_issue_the_same_collectives(case):
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        first, last = pool.map(_as_rank, [0, case.world - 1], [case] * 2)
    assert first.input_shapes != last.input_shapes, "the two ranks hold different shard shapes (the case tested)"
    assert first.merged > 0, "the pass bucketed"
    if case.plan == "blocks":  # the cost model merges a model this small into one bucket a phase: nothing to move
        assert first.moved > 0, "the pass reordered"
    assert first.cache_key == last.cache_key, (
        "no graph holds its rank's slot offset: [Note: the rank is not part of the cache key]"
    )
    assert len(first.windows) == 3, "windows around the forward gathers, the backward gathers and the reductions"
    assert first.windows == last.windows, "the cost model sees the same compute on both ranks"
    assert first.reorders == last.reorders, "the memory budget is checked on bytes every rank holds alike"
    assert len(first.reorders) == 2
    for kind, seq_first, seq_last in zip(("forward", "backward"), first.sequences, last.sequences, strict=True):
        assert len(seq_first) >= 2, f"{kind}: the graph has collectives"
        assert seq_first == seq_last, f"{kind}: rank 0 and rank {case.world - 1} issue different collectives"
