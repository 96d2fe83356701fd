"""A plain `torch.compile(model)` of a wrapped L = 8 transformer on the fake process group (world 8
and 64): bucket counts and the launch / wait order, in the post-grad FX graphs and in the code
inductor generates."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp._compat import functorch_config, inductor_config, init_fake_process_group, run_and_get_code
from simplefsdp.inspect.record import GraphRecorder
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts, is_all_gather, is_reduce_scatter, is_wait
from simplefsdp.passes.fsdp_pass import FsdpPass
from simplefsdp.passes.install import pass_of
from tests._tiers import fast_first

L8 = TransformerArgs(vocab_size=67, dim=32, n_layers=8, n_heads=4, ffn_dim=88, max_seq_len=16)
# At world 64 every dim-0 below 64 shards unevenly, and DTensor then splits each gradient into 64
# pieces to pad them (about 700 more nodes in the backward, 70 s of inductor instead of 15): widths
# that divide by 64 keep only the vocabulary (67 rows) uneven.
L8_WIDE = dataclasses.replace(L8, dim=64, ffn_dim=128)


@pytest.fixture(scope="module", params=fast_first([8, 64]))
def fake_world(request):
    init_fake_process_group(rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _compile_step(world: int, passes=simplefsdp.PassConfig()):
    """One compiled training step: (user pass with the post-grad graphs, generated code, model)."""
    torch.manual_seed(0)
    args = L8 if world < 64 else L8_WIDE
    model = simplefsdp.wrap(Transformer(args), init_device_mesh("cpu", (world,)), passes=passes)
    tokens = torch.randint(0, L8.vocab_size, (2, 8))
    compiled = torch.compile(model)
    user_pass = GraphRecorder("a user's own post-grad pass")  # must still run, after ours
    with (
        inductor_config.patch(post_grad_custom_post_pass=user_pass, fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        _, code = run_and_get_code(lambda: compiled(tokens).sum().backward())
    assert inductor_config.post_grad_custom_post_pass is None, "the model's pass must not outlive its compile"
    return user_pass, code, model


@pytest.fixture(scope="module")
def step(fake_world):
    return _compile_step(fake_world)


def test_default_plan_one_collective_per_block_plus_rest(step):
    """One bucket per block and one per run of the rest: the embedding before the blocks, the final
    norm and output after them ([Note: the rest, by runs]). The backward re-gathers the norm and
    output and the blocks, not the embedding (its gradient needs no weight), and reduces all three.
    The embedding's bucket of one stays a plain collective: no copy ops."""
    user_pass, _, model = step
    forward, backward = user_pass.graphs
    assert pass_of(model).graphs == 2, "our pass ran on the forward and the backward graph"
    fwd, bwd = collective_counts(forward), collective_counts(backward)
    assert fwd["all_gather"] == L8.n_layers + 2
    assert bwd["all_gather"] == L8.n_layers + 1, "FULL_SHARD re-gathers, bucketed the same way"
    assert bwd["reduce_scatter"] == L8.n_layers + 2
    ops = torch.ops.simplefsdp
    for graph, fused in [
        (forward, [ops.all_gather_copy_in.default, ops.all_gather_copy_out.default]),
        (backward, [ops.reduce_scatter_copy_in.default]),  # its copy-out is a view: no op
    ]:
        targets = [n.target for n in graph.nodes]
        for op in fused:
            assert targets.count(op) == L8.n_layers + 1, f"one {op} per bucket of two or more"


def test_uneven_gradients_reach_the_bucket_unpadded(step):
    """The vocabulary (67 rows) shards unevenly at 8 and 64 ranks: DTensor's split + pad + concatenation
    of its gradients is folded into one pad, which the bucket copy-in absorbs, so the copy-in reads
    the gradients themselves ([Note: why fold the uneven padding])."""
    _, backward = step[0].graphs
    copy_in = torch.ops.simplefsdp.reduce_scatter_copy_in.default
    read = [g for node in backward.find_nodes(op="call_function", target=copy_in) for g in node.args[0]]
    # every gradient but the embedding's (a bucket of one, left a plain collective; the output
    # projection shards unevenly too and is bucketed with the final norm)
    assert len(read) == len(list(step[2].parameters())) - 1, "every bucketed gradient goes through a copy-in"
    prepared = [
        g.format_node()
        for g in read
        if g.target in (torch.ops.aten.cat.default, torch.ops.aten.constant_pad_nd.default)
    ]
    assert not prepared, f"a copy-in reads a padded copy of a gradient: {prepared}"


def _events(graph: fx.Graph) -> list[tuple[str, str]]:
    """("L", name) at each launch, ("W", name of the launch) at each wait, ("mm", "") at each matmul."""
    events = []
    for node in graph.nodes:
        if is_all_gather(node) or is_reduce_scatter(node):
            events.append(("L", node.name))
        elif is_wait(node):
            events.append(("W", node.args[0].name))
        elif node.op == "call_function" and node.target is torch.ops.aten.mm.default:
            events.append(("mm", ""))
    return events


# a launch in inductor's code: `bufN = ...all_gather_into_tensor(...)` / `...reduce_scatter_tensor(...)`
# (a merged bucket's all-gather too: [Note: no rank in the graph] in passes/bucket.py), and for a gloo
# reduce-scatter bucket's in-place all-reduce (passes/backend.py), `...all_reduce_(bufN, ...)`
_ALL_REDUCE_IN_PLACE = re.compile(r"torch\.ops\._c10d_functional\.all_reduce_\.default\((buf\d+),")


def _launched(line: str, collective: str) -> str | None:
    """The buffer a launch of `collective` ("all_gather_into_tensor", "reduce_scatter_tensor" or
    "all_reduce_") on `line` produces (the one its wait names), or None."""
    if collective == "all_reduce_":
        return m.group(1) if (m := _ALL_REDUCE_IN_PLACE.search(line)) else None
    m = re.search(rf"(buf\d+) = torch\.ops\._c10d_functional\.{collective}\.default\(", line)
    return m.group(1) if m else None


def _launches(code: str, collective: str) -> list[str]:
    return [b for line in code.splitlines() if (b := _launched(line, collective))]


def _code_events(code: str) -> list[tuple[str, str]]:
    """The same events read from inductor's generated `call()` ("mm": an `extern_kernels.mm` call).

    Only matmuls count as compute here: on the CPU backend inductor may schedule the previous
    bucket's first pointwise kernel (e.g. embedding + norm) ahead of the prefetched launch, so the
    launch lands after that one kernel -- still before every matmul of the bucket it overlaps.
    """
    events = []
    for line in code[code.index("def call(self") :].splitlines():
        launched = (_launched(line, c) for c in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_"))
        if buf := next((b for b in launched if b), None):
            events.append(("L", buf))
        elif m := re.search(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)", line):
            events.append(("W", m.group(1)))
        elif "extern_kernels.mm(" in line:
            events.append(("mm", ""))
    return events


def _assert_prefetch_depth_1(events: list[tuple[str, str]], where: str) -> None:
    """All-gather i + 1 is launched before any of bucket i's matmuls (those after wait i) and waited
    after them; all-gather i + 2 only after wait i (depth 1). Without the pass each all-gather is
    launched right before its own wait, after bucket i's compute."""
    gathers = [name for kind, name in events if kind == "L" and name in _gathered(events)]
    pos = {event: i for i, event in enumerate(events)}
    for i in range(len(gathers) - 1):
        wait_i, launch_next, wait_next = pos[("W", gathers[i])], pos[("L", gathers[i + 1])], pos[("W", gathers[i + 1])]
        assert not any(kind == "mm" for kind, _ in events[wait_i:launch_next]), (
            f"{where}: gather {i + 1} launches after some of bucket {i}'s compute"
        )
        if i + 2 < len(gathers):
            assert pos[("L", gathers[i + 2])] > wait_i, f"{where}: gather {i + 2} launched too early (depth 1)"
        if i > 0:  # bucket 0 is the embedding: no matmul
            assert any(kind == "mm" for kind, _ in events[launch_next:wait_next]), (
                f"{where}: gather {i + 1} overlaps nothing"
            )


def _gathered(events):
    launched = [name for kind, name in events if kind == "L"]
    waited = {name for kind, name in events if kind == "W"}
    return [name for name in launched if name in waited]


def _reductions_overlap(events: list[tuple[str, str]], reduce_names: list[str], where: str) -> None:
    """The reduce-scatters of blocks L-1 .. 1 each launch before some compute and are waited after it
    (without the pass each is waited right after its launch). Block 0's and the rest's are launched
    after the last matmul: only the embedding's backward follows them."""
    pos = {event: i for i, event in enumerate(events)}
    overlapping = [
        name for name in reduce_names if any(kind == "mm" for kind, _ in events[pos[("L", name)] : pos[("W", name)]])
    ]
    assert len(overlapping) >= L8.n_layers - 1, f"{where}: only {overlapping} of {reduce_names} overlap compute"


def _assert_reductions_launch_on_their_last_gradient(graph: fx.Graph) -> None:
    """Between the last op producing a bucket's gradients and its reduce-scatter's launch there is only
    that launch's own chain -- the copy-in, and views feeding it -- and the wait of the reduction in
    flight with what unpacks it (the one-reduction budget waits it just before the copy-in, [Note: a
    reduction starts at its first buffer])."""
    for launch in filter(is_reduce_scatter, graph.nodes):
        chain, stack = set(), [launch.args[0]]
        while stack:
            node = stack.pop()
            if node.op == "call_function" and (
                node.target is torch.ops.simplefsdp.reduce_scatter_copy_in.default or node.target.is_view
            ):
                chain.add(node)
                stack.extend(node.all_input_nodes)
        # a bucket of one (the embedding's) launches on its gradient directly: no copy-in chain
        gradients = ({i for node in chain for i in node.all_input_nodes} - chain) or {launch.args[0]}
        between, node = [], max(gradients).next
        while node is not launch:
            between.append(node)
            node = node.next
        landed: set[fx.Node] = set()
        for node in between:
            if is_wait(node) or (node.all_input_nodes and all(i in landed for i in node.all_input_nodes)):
                landed.add(node)
        unrelated = [n.name for n in between if n not in chain and n not in landed]
        assert not unrelated, f"{launch.name} launches after unrelated ops {unrelated}"


def test_order_in_fx_graphs(step):
    user_pass, _, _ = step
    forward, backward = user_pass.graphs
    _assert_prefetch_depth_1(_events(forward), "forward FX")
    bwd = _events(backward)
    _assert_prefetch_depth_1([e for e in bwd if e[0] == "mm" or _is_gather_event(backward, e)], "backward FX")
    reductions = [n.name for n in backward.nodes if is_reduce_scatter(n)]
    _reductions_overlap(bwd, reductions, "backward FX")
    _assert_reductions_launch_on_their_last_gradient(backward)


def _is_gather_event(graph: fx.Graph, event: tuple[str, str]) -> bool:
    node = next(n for n in graph.nodes if n.name == event[1])
    return is_all_gather(node)


def test_order_survives_inductor(step):
    _, code, _ = step
    forward_code, backward_code = code
    _assert_prefetch_depth_1(_code_events(forward_code), "forward code")
    bwd = _code_events(backward_code)
    gather_bufs = set(_launches(backward_code, "all_gather_into_tensor"))
    reduce_bufs = _launches(backward_code, "reduce_scatter_tensor")
    assert len(gather_bufs) == L8.n_layers + 1, "the blocks and the norm + output (not the embedding)"
    assert len(reduce_bufs) == L8.n_layers + 2, "the blocks, the norm + output and the embedding"
    _assert_prefetch_depth_1([e for e in bwd if e[0] == "mm" or e[1] in gather_bufs], "backward code")
    _reductions_overlap(bwd, reduce_bufs, "backward code")


def test_graph_without_fsdp_collectives_is_untouched():
    graph = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())).graph
    before = str(graph)
    graph_pass = FsdpPass()
    graph_pass(graph)
    assert str(graph) == before
    assert (graph_pass.graphs, graph_pass.merged, graph_pass.moved) == (1, 0, 0)


def test_reordering_keeps_the_derived_memory_budget(step):
    """Default `ReorderConfig`: the gathers may hold one prefetched bucket, the reductions one in
    flight; the liveness walk finds each graph's peak within that, at the first attempt."""
    _, _, model = step
    results = pass_of(model).reorders
    assert len(results) == 2, "the forward and the backward"
    for result in results:
        assert result.moved > 0
        assert result.peak_after <= result.peak_before + result.allowance
        assert result.allowance == sum(result.budgets), "the whole derived budget was kept: no retry"
    forward, backward = results
    assert forward.budgets[0] > 0, "the forward gathers..."
    assert forward.budgets[1] == 0, "... and reduces nothing"
    assert backward.budgets[0] > 0, "the backward re-gathers..."
    assert backward.budgets[1] > 0, "... and reduces"
