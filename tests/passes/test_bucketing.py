"""The bucketing pass on inductor post-grad graphs (world 8, fake process group); the plan-counting
tests marked `aot_eager` record the same partitioned graphs under `simplefsdp_aot_eager` instead (the
pass runs on them as a post-grad pass, without inductor's decompositions and code generation, which
would cost them most of their time; `test_overlap.py` counts the default plan through inductor)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import c10d_functional as c10d
from simplefsdp._compat import functorch_config, inductor_config
from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.install import pass_of
from simplefsdp.passes.reorder import ReorderConfig

# inductor's post-grad graphs, ours included, without its code generation: what these tests read
AOT_EAGER = "simplefsdp_aot_eager"
ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
N_PARAMS = len(list(Transformer(ARGS).parameters()))


def _bucketed_graphs(strategy: str, config: BucketConfig, args: TransformerArgs = ARGS, *, backend: str = "inductor"):
    parsed = simplefsdp.ShardingStrategy.parse(strategy)
    mesh = init_device_mesh("cpu", (2, 4) if parsed.is_hybrid else (8,))
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(args), mesh, strategy=parsed, passes=None)  # the pass under test runs instead
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    graph_pass = FsdpPass(PassConfig(bucket=config))
    return record_step(model, lambda compiled: compiled(tokens).sum(), graph_pass=graph_pass, backend=backend).post


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_one_bucket_per_kind_when_everything_fits(fake_world8, strategy):
    forward, backward = _bucketed_graphs(strategy, BucketConfig(plan="cap", cap_bytes=2**30), backend=AOT_EAGER)
    fwd, bwd = collective_counts(forward), collective_counts(backward)
    assert fwd["all_gather"] == 1
    assert bwd["all_gather"] == 1, "the re-gathers merge too"
    assert bwd["reduce_scatter"] == 1
    assert bwd["all_reduce"] == (1 if strategy == "HYBRID_SHARD" else 0)
    assert fwd["wait"] == 1
    assert bwd["wait"] == sum(bwd[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))


L8 = TransformerArgs(vocab_size=67, dim=32, n_layers=8, n_heads=4, ffn_dim=88, max_seq_len=16)


@pytest.mark.slow  # test_overlap.py checks the same plan through inductor, in the fast tier
@pytest.mark.parametrize("world", [8])
def test_default_block_plan_one_bucket_per_block_plus_rest(fake_world8, world):
    """L = 8 blocks and the rest in two runs (the embedding before the blocks, norm + output after):
    L + 2 all-gathers forward, L + 1 re-gathers backward (the embedding's gradient needs no weight)
    and L + 2 reduce-scatters."""
    blocks = tuple(find_repeated_blocks(Transformer(L8)))
    forward, backward = _bucketed_graphs("FULL_SHARD", BucketConfig(blocks=blocks), L8, backend=AOT_EAGER)
    fwd, bwd = collective_counts(forward), collective_counts(backward)
    assert fwd["all_gather"] == L8.n_layers + 2
    assert bwd["all_gather"] == L8.n_layers + 1
    assert bwd["reduce_scatter"] == L8.n_layers + 2


@pytest.mark.slow
def test_manual_pattern_plan(fake_world8):
    patterns = ("tok_embeddings", "layers.*", "norm+output")
    plan = BucketConfig(plan="patterns", patterns=patterns)
    forward, backward = _bucketed_graphs("FULL_SHARD", plan, L8, backend=AOT_EAGER)
    assert collective_counts(forward)["all_gather"] == 1 + L8.n_layers + 1
    assert collective_counts(backward)["reduce_scatter"] == 1 + L8.n_layers + 1


@pytest.mark.slow
def test_collectives_carry_their_parameter_name(fake_world8):
    mesh = init_device_mesh("cpu", (8,))
    model = simplefsdp.wrap(Transformer(ARGS), mesh, passes=None)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    forward, backward = record_step(model, lambda compiled: compiled(tokens).sum(), backend=AOT_EAGER).post
    names = [fqn for fqn, _ in Transformer(ARGS).named_parameters()]
    assert [g.owner for g in find_fsdp_all_gathers(forward)] == names, "forward gathers in parameter order"
    assert sorted(r.owner for r in find_fsdp_reductions(backward)) == sorted(names)


def test_bad_bucket_config():
    with pytest.raises(ValueError, match="unknown bucket plan 'fancy'"):
        BucketConfig(plan="fancy")
    with pytest.raises(ValueError, match="the 'patterns' bucket plan needs patterns"):
        BucketConfig(plan="patterns")


@pytest.mark.slow
def test_tiny_cap_changes_nothing(fake_world8):
    forward, backward = _bucketed_graphs("FULL_SHARD", BucketConfig(plan="cap", cap_bytes=1), backend=AOT_EAGER)
    assert len(find_fsdp_all_gathers(forward)) == N_PARAMS
    assert len(find_fsdp_reductions(backward)) == N_PARAMS


def test_dependent_reductions_are_not_merged():
    """A reduce-scatter whose input is computed from another one's result must stay separate."""
    from simplefsdp._compat import FakeTensorMode
    from simplefsdp.passes.bucket import apply_reduction_buckets, independent
    from simplefsdp.passes.plan import Bucket

    aten = torch.ops.aten
    with FakeTensorMode() as mode:
        grad = mode.from_tensor(torch.zeros(16))
        shard = torch.empty(2)
    g = torch.fx.Graph()
    x = g.placeholder("grad")
    x.meta["val"] = grad
    rs1 = g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 8, "0"))
    w1 = g.call_function(c10d.wait_tensor.default, (rs1,))
    y = g.call_function(aten.repeat.default, (w1, [8]))  # depends on the first reduction's result
    rs2 = g.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 8, "0"))
    w2 = g.call_function(c10d.wait_tensor.default, (rs2,))
    for node, val in [(rs1, shard), (w1, shard), (y, grad), (rs2, shard), (w2, shard)]:
        node.meta["val"] = val
    g.output((w1, w2))
    reductions = find_fsdp_reductions(g)
    assert len(reductions) == 2
    assert not independent(reductions)
    assert apply_reduction_buckets(g, reductions, [Bucket((0, 1))]) == 0
    assert [n.target for n in g.nodes if n.op == "call_function"].count(c10d.reduce_scatter_tensor.default) == 2


@pytest.mark.slow
def test_passes_off_leave_one_collective_per_parameter(fake_world8):
    mesh = init_device_mesh("cpu", (8,))
    model = simplefsdp.wrap(Transformer(ARGS), mesh, passes=None)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    forward, backward = record_step(model, lambda compiled: compiled(tokens).sum(), backend=AOT_EAGER).post
    assert pass_of(model) is None
    assert collective_counts(forward)["all_gather"] == N_PARAMS
    assert collective_counts(backward)["reduce_scatter"] == N_PARAMS


def test_auto_plan_on_a_real_graph_is_valid_and_deterministic(fake_world8):
    """The cost-model plan on a real graph: between one and one-per-parameter collectives, the same twice."""
    config = BucketConfig(plan="auto", device="h100")
    counts = []
    for _ in range(2):
        torch.compiler.reset()
        forward, backward = _bucketed_graphs("FULL_SHARD", config, backend=AOT_EAGER)
        counts.append((collective_counts(forward)["all_gather"], collective_counts(backward)["reduce_scatter"]))
    assert counts[0] == counts[1]
    assert 1 <= counts[0][0] < N_PARAMS
    assert 1 <= counts[0][1] < N_PARAMS


@pytest.mark.slow
def test_model_inside_a_compiled_step(fake_world8):
    """Called from a larger compiled function, the wrapped model traces without a graph break
    (fullgraph=True); its pass runs when the compiling call is inside `compile_scope(model)`."""
    from simplefsdp.passes.install import compile_scope

    model = simplefsdp.wrap(Transformer(ARGS), init_device_mesh("cpu", (8,)))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))

    @torch.compile(fullgraph=True)
    def step(tokens):
        return model(tokens).sum()

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        step(tokens).backward()
        assert pass_of(model).graphs == 0, "outside compile_scope(): the compile config was fixed before the model"
        torch.compiler.reset()
        with compile_scope(model):
            step(tokens).backward()
    assert pass_of(model).graphs == 2
    assert pass_of(model).merged > 0


def _launch_wait_order(graph: torch.fx.Graph, predicate) -> list[str]:
    from simplefsdp.passes.collectives import is_wait

    order = []
    for node in graph.nodes:
        if predicate(node):
            order.append(f"L{len([o for o in order if o.startswith('L')])}")
        elif is_wait(node) and predicate(node.args[0]):
            order.append("W")
    return order


def _reordered_graphs(fake_world8, reorder: ReorderConfig, *, backend: str = "inductor"):
    """(the forward and backward graphs after a pass bucketing per block and reordering, that pass)."""
    torch.compiler.reset()  # a fresh compile: Dynamo would reuse the previous model's graph
    mesh = init_device_mesh("cpu", (8,))
    model = simplefsdp.wrap(Transformer(L8), mesh, passes=None)
    tokens = torch.randint(0, L8.vocab_size, (2, 8))
    blocks = tuple(find_repeated_blocks(model))
    graph_pass = FsdpPass(PassConfig(bucket=BucketConfig(blocks=blocks), reorder=reorder))
    step = record_step(model, lambda compiled: compiled(tokens).sum(), graph_pass=graph_pass, backend=backend)
    return step.post, graph_pass


@pytest.mark.slow  # the fast tier reorders under the default allowance (test_overlap.py)
def test_no_peak_growth_still_prefetches_where_there_is_room(fake_world8):
    """`max_peak_growth_bytes=0` ([Note: placing by slack]): neither graph's peak live bytes grow, yet
    the forward prefetches its first blocks' gathers (few activations are live there), and the
    default allowance prefetches at least as many."""
    from simplefsdp.passes.collectives import is_all_gather

    peaks, prefetched = {}, {}
    for growth in (0, None):
        reorder = ReorderConfig(max_peak_growth_bytes=growth)
        (forward, _), graph_pass = _reordered_graphs(fake_world8, reorder, backend=AOT_EAGER)
        assert len(graph_pass.reorders) == 2
        peaks[growth] = [(r.peak_before, r.peak_after, r.allowance) for r in graph_pass.reorders]
        prefetched[growth] = graph_pass.moved
        if growth == 0:
            assert _launch_wait_order(forward, is_all_gather)[:4] == ["L0", "L1", "W", "L2"]
    assert all(after <= before and allowance == 0 for before, after, allowance in peaks[0])
    assert all(after <= before + allowance for before, after, allowance in peaks[None])
    assert 0 < prefetched[0] <= prefetched[None]


@pytest.mark.slow
def test_prefetch_depth_and_memory_budget(fake_world8):
    """Depth 2 launches two gathers ahead; a budget smaller than one bucket leaves no prefetch and
    waits every reduce-scatter before the next one launches."""
    from simplefsdp.passes.collectives import is_all_gather, is_reduce_scatter

    n = L8.n_layers + 2  # gathers forward, reductions backward: the blocks and the rest's two runs
    (forward, _), _ = _reordered_graphs(fake_world8, ReorderConfig(prefetch_depth=2), backend=AOT_EAGER)
    assert _launch_wait_order(forward, is_all_gather)[:4] == ["L0", "L1", "L2", "W"]
    (forward, backward), _ = _reordered_graphs(fake_world8, ReorderConfig(max_in_flight_bytes=1), backend=AOT_EAGER)
    assert _launch_wait_order(forward, is_all_gather) == [x for i in range(n) for x in (f"L{i}", "W")]
    assert _launch_wait_order(backward, is_reduce_scatter) == [x for i in range(n) for x in (f"L{i}", "W")]
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0"):
        ReorderConfig(prefetch_depth=-1)


def test_gathers_on_different_process_groups_are_not_merged():
    """Two parameter all-gathers on groups "0" and "1": even a plan that would take everything keeps them apart."""
    from simplefsdp._compat import FakeTensorMode

    with FakeTensorMode() as mode:
        shard = mode.from_tensor(torch.zeros(4))
    g = torch.fx.Graph()
    waits = []
    for i, group in enumerate(["0", "1"]):
        x = g.placeholder(f"shard{i}")
        x.meta["val"] = shard
        ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, group))
        waits.append(g.call_function(c10d.wait_tensor.default, (ag,)))
    g.output(tuple(waits))
    graph_pass = FsdpPass(PassConfig(bucket=BucketConfig(plan="cap", cap_bytes=2**30), reorder=None))
    graph_pass(g)
    assert graph_pass.merged == 0
    assert [n.args[2] for n in g.nodes if n.target is c10d.all_gather_into_tensor.default] == ["0", "1"]


def test_only_dim0_tail_pads_are_folded_into_the_copy_in(fake_world8):
    """The copy-in op pads each shard at its end (dim 0 rows); any other pad stays in the graph."""
    from simplefsdp._compat import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode() as mode:
        shard = mode.from_tensor(torch.zeros(3, 4))
        vals = {
            "rows": aten.constant_pad_nd.default(shard, [0, 0, 0, 1]),
            "cols": aten.constant_pad_nd.default(shard, [1, 0]),
        }
        gathered = {name: torch.empty(8 * v.shape[0], v.shape[1]) for name, v in vals.items()}
    g = torch.fx.Graph()
    waits, pads = [], {}
    for name, pad in [("rows", [0, 0, 0, 1]), ("cols", [1, 0])]:
        x = g.placeholder(name)
        x.meta["val"] = shard
        pads[name] = g.call_function(aten.constant_pad_nd.default, (x, pad))
        pads[name].meta["val"] = vals[name]
        ag = g.call_function(c10d.all_gather_into_tensor.default, (pads[name], 8, "0"))
        waits.append(g.call_function(c10d.wait_tensor.default, (ag,)))
        ag.meta["val"] = waits[-1].meta["val"] = gathered[name]
    g.output(tuple(waits))
    FsdpPass(PassConfig(bucket=BucketConfig(plan="cap", cap_bytes=2**30), reorder=None))(g)
    g.lint()
    remaining = [n for n in g.nodes if n.target is aten.constant_pad_nd.default]
    assert remaining == [pads["cols"]], "the row pad is done by the copy-in, the column pad is not"
    (copy_in,) = [n for n in g.nodes if n.target is torch.ops.simplefsdp.all_gather_copy_in.default]
    assert copy_in.args[1] == [16, 15], "chunks: the padded sizes"


def test_a_model_without_repeated_blocks_is_bucketed_by_size(fake_world8, caplog):
    """The block plan would gather the whole model in one bucket; wrap() says so and caps buckets instead."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with caplog.at_level("WARNING", logger="simplefsdp.wrap"):
        simplefsdp.wrap(model, init_device_mesh("cpu", (8,)))
    assert pass_of(model).config.bucket.plan == "cap"
    assert "Sequential has no repeated blocks" in caplog.text
    assert "BucketConfig(plan='patterns'" in caplog.text


def test_a_cast_chain_keeps_its_intermediate_rounding(fake_world8):
    """fp32 -> bf16 -> fp32 before an all-gather rounds to bf16: the copy-in casts once, so only the
    last cast folds into it and the bf16 cast stays in the graph."""
    from simplefsdp._compat import FakeTensorMode

    prims = torch.ops.prims
    with FakeTensorMode() as mode:
        shard = mode.from_tensor(torch.zeros(4, 4))
        low, gathered = shard.to(torch.bfloat16), torch.empty(32, 4)
    g = torch.fx.Graph()
    waits = []
    for name in ("a", "b"):
        x = g.placeholder(name)
        x.meta["val"] = shard
        down = g.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
        up = g.call_function(prims.convert_element_type.default, (down, torch.float32))
        down.meta["val"], up.meta["val"] = low, shard
        ag = g.call_function(c10d.all_gather_into_tensor.default, (up, 8, "0"))
        waits.append(g.call_function(c10d.wait_tensor.default, (ag,)))
        ag.meta["val"] = waits[-1].meta["val"] = gathered
    g.output(tuple(waits))
    graph_pass = FsdpPass(PassConfig(bucket=BucketConfig(plan="cap", cap_bytes=2**30), reorder=None))
    graph_pass(g)
    assert graph_pass.merged == 1
    casts = [n.args[1] for n in g.nodes if n.target is prims.convert_element_type.default]
    assert casts == [torch.bfloat16, torch.bfloat16], "each shard's bf16 rounding is kept; the copy-in casts back"


def test_float64_parameters_keep_their_own_collectives(fake_world8, caplog):
    """The bucket copy ops handle fp32 / bf16 / fp16: fp64 parameters are left as traced, the pass
    says so (it used to drop them from the merge silently), and the model trains (no error from a
    copy op at the first step)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))).double()
    graph_pass = pass_of(simplefsdp.wrap(model, init_device_mesh("cpu", (8,))))
    compiled = torch.compile(model, backend="simplefsdp_aot_eager")
    with caplog.at_level("WARNING", logger="simplefsdp.passes.bucket"):
        compiled(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    said = [r.getMessage() for r in caplog.records if "keep their own collective" in r.getMessage()]
    assert len(said) == 2, said  # forward and backward graph
    assert all("torch.float64" in m for m in said), said
    assert graph_pass.graphs == 2
    assert graph_pass.merged == 0
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model.parameters())
