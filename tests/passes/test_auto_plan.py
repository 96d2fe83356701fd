"""The auto plan on real graphs (world 8, fake process group; the min-cut partitioned graphs the
post-grad pass gets, under `simplefsdp_aot_eager`): prefetch depth and bucket sizes follow the
profile's overlap and the memory budget; the plan is a function of graph, profile and budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes import cost
from simplefsdp.passes.collectives import find_collectives
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.liveness import peak_bytes

# The pass runs as in inductor (post-grad, on min-cut partitioned graphs) but the graphs then run op
# by op: the plan is what these tests check, and inductor's code generation would triple their time.
BACKEND = "simplefsdp_aot_eager"
L6 = TransformerArgs(vocab_size=64, dim=64, n_layers=6, n_heads=4, ffn_dim=128, max_seq_len=16)


def _profile_file(tmp_path, *, overlap: float) -> str:
    device = dataclasses.replace(cost.profile("cpu-gloo"), name=f"test-overlap-{overlap}", overlap=overlap)
    path = tmp_path / f"overlap-{overlap}.json"
    cost.save_profile(device, path)
    return str(path)


def _compile(config: BucketConfig):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(L6), init_device_mesh("cpu", (8,)), passes=None)
    graph_pass = FsdpPass(PassConfig(bucket=config))
    tokens = torch.randint(0, L6.vocab_size, (2, 8))
    step = record_step(model, lambda compiled: compiled(tokens).sum(), graph_pass=graph_pass, backend=BACKEND)
    return step, graph_pass


def _gathers(graph):
    return find_collectives(graph, kinds=["all_gather"])


@pytest.mark.slow
def test_no_overlap_means_no_prefetch_and_few_buckets(fake_world8, tmp_path):
    """A profile on which communication never runs beside compute: prefetching buys nothing, so the
    forward gathers in as few collectives as the cap allows, waited where they are launched."""
    graphs, graph_pass = _compile(BucketConfig(plan="auto", device=_profile_file(tmp_path, overlap=0.0)))
    forward = graph_pass.reorders[0]
    assert forward.budgets[0] == 0, "prefetch depth 0 chosen"
    assert len(_gathers(graphs.forward)) == 1, "everything fits the default cap: one gather"


@pytest.mark.slow
def test_full_overlap_prefetches(fake_world8, tmp_path):
    graphs, graph_pass = _compile(BucketConfig(plan="auto", device=_profile_file(tmp_path, overlap=1.0)))
    assert graph_pass.reorders[0].budgets[0] > 0, "prefetch depth 1 chosen"
    assert len(_gathers(graphs.forward)) > 1, "smaller buckets hide behind the previous one's compute"


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_a_tighter_budget_gives_smaller_buckets_within_it(fake_world8, tmp_path, overlap):
    device = _profile_file(tmp_path, overlap=overlap)
    counts = {}
    for fraction in (0.05, 4.0):
        graphs, graph_pass = _compile(BucketConfig(plan="auto", device=device, memory_budget=fraction))
        budget = int(fraction * peak_bytes(graphs.forward_pre))
        depth = 1 if graph_pass.reorders[0].budgets[0] else 0
        gathers = _gathers(graphs.forward)
        counts[fraction] = len(gathers)
        merged = [g for g in gathers if g.launch.kwargs.get("out") is not None]  # the bucket all-gathers
        assert all(g.full_nbytes * (depth + 1) <= budget for g in merged), f"budget {budget} at depth {depth}"
        for result in graph_pass.reorders:
            assert result.peak_after <= result.peak_before + result.allowance
    assert counts[0.05] > counts[4.0], counts


@pytest.mark.slow
def test_a_costly_wait_right_after_the_launch_makes_the_plan_prefetch(fake_world8, tmp_path):
    """[Note: what a bucket costs whatever overlaps it]: with no overlap and a tight budget, prefetch
    depth 0 wins (depth 1 halves the buckets for nothing); a profile whose waits right after a
    launch cost a second each turns that round (at depth 0 every gather is one, at depth 1 the first)."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), name="no-overlap", overlap=0.0)
    depths = {}
    for wait_s in (0.0, 1.0):
        path = tmp_path / f"wait-{wait_s}.json"
        cost.save_profile(dataclasses.replace(base, step_exposed_wait_s=wait_s), path)
        graphs, graph_pass = _compile(BucketConfig(plan="auto", device=str(path), memory_budget=0.05))
        depths[wait_s] = (1 if graph_pass.reorders[0].budgets[0] else 0, len(_gathers(graphs.forward)))
    assert depths[0.0][0] == 0, depths
    assert depths[1.0][0] == 1, depths
    assert depths[0.0][1] > 1, "the budget splits the gathers: depth 0 has several waits right after a launch"


@pytest.mark.slow
def test_a_costly_collective_behind_compute_makes_the_plan_wait_at_once(fake_world8, tmp_path):
    """The other sign of the same term: with full overlap and no budget, prefetch depth 1 wins; a
    profile whose collectives run behind compute cost a second each (`step_hidden_s`) turns that
    round (at depth 1 every gather but the first is one, at depth 0 none)."""
    base = dataclasses.replace(cost.profile("cpu-gloo"), name="full-overlap", overlap=1.0)
    depths = {}
    for hidden_s in (0.0, 1.0):
        path = tmp_path / f"hidden-{hidden_s}.json"
        cost.save_profile(dataclasses.replace(base, step_hidden_s=hidden_s), path)
        graphs, graph_pass = _compile(BucketConfig(plan="auto", device=str(path)))
        depths[hidden_s] = (1 if graph_pass.reorders[0].budgets[0] else 0, len(_gathers(graphs.forward)))
    assert depths[0.0][0] == 1, depths
    assert depths[1.0][0] == 0, depths
    assert depths[0.0][1] >= 2, "at depth 1 every gather but the first runs behind compute"


@pytest.mark.slow
def test_the_plan_is_a_function_of_graph_profile_and_budget(fake_world8, tmp_path):
    config = BucketConfig(plan="auto", device=_profile_file(tmp_path, overlap=0.5), memory_budget=0.5)
    first, _ = _compile(config)
    second, _ = _compile(config)
    for a, b in zip(first.post, second.post, strict=True):
        assert [(c.kind, c.full_nbytes) for c in find_collectives(a)] == [
            (c.kind, c.full_nbytes) for c in find_collectives(b)
        ]


def test_memory_budget_is_checked():
    with pytest.raises(ValueError, match="memory_budget is for the 'auto' plan"):
        BucketConfig(memory_budget=0.5)
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        BucketConfig(plan="auto", memory_budget=0)
    with pytest.raises(ValueError, match="memory budget 'lots'"):
        simplefsdp.passes.fsdp_pass.parse_memory_budget("lots")
    assert simplefsdp.passes.fsdp_pass.parse_memory_budget("512MiB") == 512 * 2**20
    assert BucketConfig(plan="auto", memory_budget=0.5).budget_bytes(1000) == 500


def test_a_bucket_costs_its_launch_and_its_copy_calls_where_measured():
    """[Note: what a bucket costs whatever overlaps it]: a gather bucket pays its launch (on the full
    buffer) and a copy-in and a copy-out call; a reduction one copy-in; a lone collective no copy op."""
    from simplefsdp.passes.auto_plan import bucket_fixed_seconds
    from simplefsdp.passes.plan import MergeKey

    measured = dataclasses.replace(
        cost.profile("cpu-gloo"),
        launch=(("all_gather", 1e-4, 1e-9), ("reduce_scatter", 2e-4, 0.0)),
        copy_ops=(
            ("all_gather_copy_in", 3e-5, 5e-6),
            ("all_gather_copy_out", 2e-5, 8e-6),
            ("reduce_scatter_copy_in", 1e-5, 1e-6),
        ),
    )
    gather = MergeKey(kind="all_gather", group_name="0", group_size=2, dtype=torch.float32, reduce_op=None)
    scatter = dataclasses.replace(gather, kind="reduce_scatter", reduce_op="avg")
    assert bucket_fixed_seconds(measured, key=gather, nbytes=1000, members=4) == pytest.approx(
        1e-4 + 1e-9 * 2000 + (3e-5 + 4 * 5e-6) + (2e-5 + 4 * 8e-6)
    )
    assert bucket_fixed_seconds(measured, key=gather, nbytes=1000, members=1) == pytest.approx(1e-4 + 1e-9 * 2000)
    assert bucket_fixed_seconds(measured, key=scatter, nbytes=1000, members=3) == pytest.approx(2e-4 + 1e-5 + 3e-6)
    assert bucket_fixed_seconds(cost.profile("cpu-gloo"), key=gather, nbytes=1000, members=4) == 0.0, "named: none"
    stepped = dataclasses.replace(measured, step_collective_s=4e-4)  # [Note: what a collective costs a step]
    assert bucket_fixed_seconds(stepped, key=scatter, nbytes=1000, members=3) == pytest.approx(
        4e-4 + 2e-4 + 1e-5 + 3e-6
    )
    assert bucket_fixed_seconds(stepped, key=gather, nbytes=1000, members=1) == pytest.approx(4e-4 + 1e-4 + 2e-6)
