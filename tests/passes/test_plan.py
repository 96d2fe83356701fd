"""Bucket plans: invariants under hypothesis, and the three planners on a real model's structure."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from simplefsdp.blocks import find_repeated_blocks, validate_patterns
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.plan import (
    Bucket,
    Candidate,
    MergeKey,
    check_plan,
    exposed_seconds,
    plan_by_blocks,
    plan_by_cap,
    plan_by_cost,
    plan_by_patterns,
)


def _key(kind: str = "all_gather", group: str = "0", dtype: torch.dtype = torch.bfloat16) -> MergeKey:
    return MergeKey(
        kind=kind, group_name=group, group_size=8, dtype=dtype, reduce_op=None if kind == "all_gather" else "avg"
    )


KEYS = [_key(group="0"), _key(group="1"), _key(group="0", dtype=torch.float32)]
OWNERS = ["tok_embeddings.weight", "layers.0.wq.weight", "layers.0.w1.weight", "layers.1.wq.weight",
          "layers.1.w1.weight", "layers.10.wq.weight", "norm.weight", "output.weight"]  # fmt: skip


@st.composite
def candidate_lists(draw):
    n = draw(st.integers(0, 40))
    return [
        Candidate(
            index=i,
            key=draw(st.sampled_from(KEYS)),
            nbytes=draw(st.integers(0, 5000)),
            owner=draw(st.sampled_from(OWNERS)),
        )
        for i in range(n)
    ]


@settings(max_examples=200, deadline=None)
@given(candidates=candidate_lists(), cap=st.integers(1, 6000))
@pytest.mark.slow
def test_cap_plan_invariants(candidates, cap):
    buckets = plan_by_cap(candidates, cap_bytes=cap)
    check_plan(candidates, buckets)
    sizes = {c.index: c.nbytes for c in candidates}
    for bucket in buckets:
        total = sum(sizes[i] for i in bucket.members)
        assert total <= cap or len(bucket.members) == 1, "only a single oversize candidate may exceed the cap"


@settings(max_examples=200, deadline=None)
@given(candidates=candidate_lists())
def test_block_plan_invariants(candidates):
    buckets = plan_by_blocks(candidates, blocks=["layers.0", "layers.1", "layers.10"])
    check_plan(candidates, buckets)
    owners = {c.index: c.owner for c in candidates}
    for bucket in buckets:
        blocks = {".".join(owners[i].split(".")[:2]) if owners[i].startswith("layers.") else "rest"
                  for i in bucket.members}  # fmt: skip
        assert len(blocks) == 1, f"a bucket spans blocks {blocks}"


@settings(max_examples=200, deadline=None)
@given(candidates=candidate_lists())
def test_pattern_plan_invariants(candidates):
    patterns = ["tok_embeddings", "layers.*", "norm+output"]
    check_plan(candidates, plan_by_patterns(candidates, patterns=patterns))


def _cands(owners, key=KEYS[0], nbytes=10):
    return [Candidate(index=i, key=key, nbytes=nbytes, owner=o) for i, o in enumerate(owners)]


def test_layers_prefix_does_not_capture_longer_indices():
    """`layers.1` must not own `layers.10.*`."""
    cands = _cands(["layers.1.wq.weight", "layers.10.wq.weight"])
    assert [b.members for b in plan_by_blocks(cands, blocks=["layers.1", "layers.10"])] == [(0,), (1,)]


def test_block_plan_buckets_the_rest_by_runs_between_blocks():
    """The parameters outside the blocks: one bucket per run between blocks in graph order
    ([Note: the rest, by runs]) -- the embedding alone before the blocks, norm + output after them."""
    cands = _cands(OWNERS)
    plan = plan_by_blocks(cands, blocks=["layers.0", "layers.1", "layers.10"])
    assert [b.members for b in plan] == [(0,), (1, 2), (3, 4), (5,), (6, 7)]
    interleaved = _cands(["pos.weight", "layers.0.wq.weight", "mid.weight", "layers.1.wq.weight", "head.weight"])
    plan = plan_by_blocks(interleaved, blocks=["layers.0", "layers.1"])
    assert [b.members for b in plan] == [(0,), (1,), (2,), (3,), (4,)]
    assert [b.members for b in plan_by_blocks(cands, blocks=[])] == [tuple(range(len(OWNERS)))], "no blocks: one run"


def test_patterns_bucket_per_block_and_join_alternatives():
    cands = _cands(OWNERS)
    plan = plan_by_patterns(cands, patterns=["tok_embeddings", "layers.*", "norm+output"])
    assert [b.members for b in plan] == [(0,), (1, 2), (3, 4), (5,), (6, 7)]


def test_oversize_candidate_gets_its_own_bucket():
    cands = [Candidate(index=i, key=KEYS[0], nbytes=n) for i, n in enumerate([10, 1000, 10, 10])]
    assert [b.members for b in plan_by_cap(cands, cap_bytes=100)] == [(0,), (1,), (2, 3)]


def test_different_keys_never_merge():
    cands = [Candidate(index=i, key=KEYS[k], nbytes=1) for i, k in enumerate([0, 1, 0])]
    assert [b.members for b in plan_by_cap(cands, cap_bytes=100)] == [(0, 2), (1,)]
    assert [b.members for b in plan_by_blocks(cands, blocks=[])] == [(0, 2), (1,)]


def test_check_plan_names_each_broken_invariant():
    cands = [Candidate(index=i, key=KEYS[k], nbytes=1) for i, k in enumerate([0, 0, 2])]
    check_plan(cands, [Bucket((0, 1)), Bucket((2,))])
    for buckets, what in [
        ([Bucket((0, 1))], "partition"),
        ([Bucket((0, 1)), Bucket((1, 2))], "partition"),
        ([Bucket((1, 0)), Bucket((2,))], "out of graph order"),
        ([Bucket((0,)), Bucket((1, 2))], "mixes merge keys"),
        ([Bucket((2,)), Bucket((0, 1))], "ordered by their first member"),
    ]:
        with pytest.raises(RuntimeError, match=what):
            check_plan(cands, buckets)


def test_repeated_blocks_of_the_reference_transformer():
    model = Transformer(TransformerArgs(n_layers=3))
    assert find_repeated_blocks(model) == ["layers.0", "layers.1", "layers.2"]


def test_repeated_blocks_in_sequential_and_moduledict_containers():
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # mixed classes inside: not itself a block list

    model = nn.Module()
    model.stem = nn.Linear(4, 4)
    model.stage = nn.Sequential(block(), block())
    model.layers = nn.ModuleDict({"0": block(), "7": block()})
    model.head = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    assert find_repeated_blocks(model) == ["stage.0", "stage.1", "layers.0", "layers.7"]
    nested = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]) for _ in range(2)])
    assert find_repeated_blocks(nested)[:2] == ["0", "1"], "the outer container first"
    assert find_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_bad_cap_and_unmatched_pattern():
    with pytest.raises(ValueError, match="cap_bytes must be positive, got 0"):
        plan_by_cap([], cap_bytes=0)
    model = Transformer(TransformerArgs(n_layers=2))
    validate_patterns(["tok_embeddings", "layers.*", "norm+output"], model)
    with pytest.raises(ValueError, match=r"bucket patterns \['decoder\.\*'\] match no parameter of Transformer"):
        validate_patterns(["layers.*", "decoder.*"], model)


def _latency_bandwidth(alpha: float, per_byte: float):
    return lambda key, nbytes: alpha + per_byte * nbytes


@settings(max_examples=150, deadline=None)
@given(candidates=candidate_lists(), cap=st.integers(1, 6000), data=st.data())
def test_cost_plan_invariants(candidates, cap, data):
    windows = [data.draw(st.floats(0, 1e-3)) for _ in range(len(candidates) + 1)]
    comm = _latency_bandwidth(alpha=data.draw(st.floats(0, 1e-4)), per_byte=data.draw(st.floats(0, 1e-6)))
    buckets = plan_by_cost(candidates, windows_s=windows, comm_s=comm, cap_bytes=cap)
    check_plan(candidates, buckets)
    sizes = {c.index: c.nbytes for c in candidates}
    for bucket in buckets:
        assert sum(sizes[i] for i in bucket.members) <= cap or len(bucket.members) == 1
    assert buckets == plan_by_cost(candidates, windows_s=windows, comm_s=comm, cap_bytes=cap), "deterministic"


def _same_key(n: int, nbytes: int = 1000, kind: str = "all_gather") -> list[Candidate]:
    return [Candidate(index=i, key=_key(kind), nbytes=nbytes) for i in range(n)]


def test_cost_plan_merges_everything_when_latency_dominates():
    """No compute to hide behind: every extra collective only adds latency, so one bucket."""
    buckets = plan_by_cost(_same_key(6), windows_s=[0.0] * 7, comm_s=_latency_bandwidth(1e-3, 1e-9), cap_bytes=10**9)
    assert [b.members for b in buckets] == [(0, 1, 2, 3, 4, 5)]


def test_cost_plan_splits_when_compute_hides_the_next_bucket():
    """Plenty of compute per candidate, bandwidth-bound transfers: a small first bucket (exposed), then
    buckets whose transfer hides behind the previous bucket's compute -- less exposed than one big one."""
    comm = _latency_bandwidth(1e-6, 1e-6)  # 1000 bytes -> ~1 ms
    buckets = plan_by_cost(_same_key(6), windows_s=[5e-3] * 7, comm_s=comm, cap_bytes=10**9)
    assert len(buckets) > 1
    assert buckets[0].members == (0,), "the first bucket is exposed: keep it small"


def test_cost_plan_takes_reductions_from_the_last():
    """A reduction runs behind the compute after its launch: the last one launched overlaps nothing,
    so the plan keeps the *last* bucket small (for all-gathers, the first: see the test above)."""
    comm = _latency_bandwidth(1e-6, 1e-6)
    buckets = plan_by_cost(_same_key(6, kind="reduce_scatter"), windows_s=[5e-3] * 7, comm_s=comm, cap_bytes=10**9)
    assert len(buckets) > 1
    assert buckets[-1].members == (5,), "the last bucket is exposed: keep it small"


def test_a_fixed_cost_per_bucket_merges_what_overlap_would_split():
    """The split case above, with each bucket also costing a fixed 10 ms whatever runs beside it
    (issuing it, its copy ops' calls): hiding 5 of the 6 ms of transfer behind compute no longer pays
    for a second bucket (one: 6 + 10 ms; the split: 1 + 0 + 2 * 10 ms)."""
    comm = _latency_bandwidth(1e-6, 1e-6)
    fixed = []

    def fixed_s(key, nbytes, members):
        fixed.append((key.kind, nbytes, members))
        return 10e-3

    split = plan_by_cost(_same_key(6), windows_s=[5e-3] * 7, comm_s=comm, cap_bytes=10**9)
    assert len(split) > 1, "without the fixed cost: split (the test above)"
    buckets = plan_by_cost(_same_key(6), windows_s=[5e-3] * 7, comm_s=comm, cap_bytes=10**9, fixed_s=fixed_s)
    assert [b.members for b in buckets] == [(0, 1, 2, 3, 4, 5)]
    assert ("all_gather", 6000, 6) in fixed, "charged per bucket, with its bytes and member count"
    model = {"windows_s": [5e-3] * 7, "comm_s": comm}
    without = exposed_seconds(_same_key(6), buckets, **model)
    assert exposed_seconds(_same_key(6), buckets, **model, fixed_s=fixed_s) == pytest.approx(without + 10e-3)


def test_cost_plan_respects_the_cap():
    buckets = plan_by_cost(_same_key(6), windows_s=[0.0] * 7, comm_s=_latency_bandwidth(1e-3, 0), cap_bytes=2000)
    assert [b.members for b in buckets] == [(0, 1), (2, 3), (4, 5)]


@settings(max_examples=150, deadline=None)
@given(candidates=candidate_lists(), cap=st.integers(1, 6000), data=st.data())
def test_cost_plan_exposes_no_more_than_other_plans(candidates, cap, data):
    """`plan_by_cost` minimises `exposed_seconds`: no plan under the same cap exposes less."""
    windows = [data.draw(st.floats(0, 1e-3)) for _ in range(len(candidates) + 1)]
    comm = _latency_bandwidth(alpha=data.draw(st.floats(0, 1e-4)), per_byte=data.draw(st.floats(0, 1e-6)))
    overlap = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
    per_bucket, per_member = data.draw(st.floats(0, 1e-4)), data.draw(st.floats(0, 1e-5))
    fixed = data.draw(st.sampled_from([None, lambda key, nbytes, members: per_bucket + per_member * members]))
    kwargs = {"windows_s": windows, "comm_s": comm, "overlap": overlap, "fixed_s": fixed}
    best = exposed_seconds(candidates, plan_by_cost(candidates, cap_bytes=cap, **kwargs), **kwargs)
    for other in (plan_by_cap(candidates, cap_bytes=cap), plan_by_cap(candidates, cap_bytes=1)):
        assert best <= exposed_seconds(candidates, other, **kwargs) + 1e-9
