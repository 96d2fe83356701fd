"""The copies of offloaded shards in the compiled step: present, and placed to overlap compute.

A 3-block transformer, FULL_SHARD, world 8 on the fake process group, everything offloaded; the
post-grad graphs as the pass leaves them (`simplefsdp_aot_eager`: partitioned as inductor would).
[Note: where offload copies sit] (`passes/host_copies.py`) says where they belong. The mesh is on
the CPU, so the copies land on the CPU: tracing the step with fake CUDA tensors aborts on a CPU-only
build (autograd has no device guard for CUDA), and the ops and the pass are the same either way.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp
from simplefsdp.inspect.record import StepGraphs, record_step
from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_IN
from simplefsdp.kernels.host_copy import COPY_START, COPY_WAIT, is_copy_start, is_copy_wait
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.offload import device_copy_of

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=3, n_heads=4, ffn_dim=88, max_seq_len=16)
N_PARAMS = len(list(Transformer(ARGS).parameters()))
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _trace(passes: simplefsdp.PassConfig | None) -> StepGraphs:
    torch.manual_seed(0)
    model = simplefsdp.wrap(  # the blocks' matmuls in the step's graph (no regions): the copies are placed around them
        Transformer(ARGS),
        init_device_mesh("cpu", (8,)),
        offload=simplefsdp.OffloadPolicy(),
        passes=passes,
        compile_regions=False,
    )
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    return record_step(model, lambda compiled: compiled(tokens).sum(), backend="simplefsdp_aot_eager")


@pytest.fixture(scope="module")
def graphs(fake_world8) -> StepGraphs:
    return _trace(simplefsdp.PassConfig())


def _copies(graph: torch.fx.Graph) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    return [n for n in graph.nodes if is_copy_start(n)], [n for n in graph.nodes if is_copy_wait(n)]


def test_every_gather_copies_its_shard_in_and_every_gradient_copies_out(graphs):
    forward, backward = graphs.post
    starts, waits = _copies(forward)
    assert len(starts) == len(waits) == N_PARAMS  # each parameter's shard, once
    back_starts, back_waits = _copies(backward)
    regathered = [start for copy_in in _bucket_copy_ins(backward) for start in _feeding_starts(copy_in)]
    # FULL_SHARD re-gathers in backward (all but the embedding, whose backward never reads it): each
    # re-gather copies its shard in again; each gradient is copied out once
    assert len(regathered) == N_PARAMS - 1
    assert len(back_starts) == len(back_waits) == (N_PARAMS - 1) + N_PARAMS
    for wait in waits:  # each wait reads its own start's token and source
        token, source = wait.args
        assert token.target is COPY_START
        assert token.args[0] is source


def _bucket_copy_ins(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is ALL_GATHER_COPY_IN]


def _feeding_starts(copy_in: torch.fx.Node) -> list[torch.fx.Node]:
    waits = [n for n in copy_in.all_input_nodes if is_copy_wait(n)]
    waits += [i for n in copy_in.all_input_nodes for i in n.all_input_nodes if is_copy_wait(i)]  # through a view
    return [w.args[0] for w in waits]


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_bucket_copy_starts_before_the_previous_bucket_launches(graphs, which):
    """Bucket j's shards start copying before bucket j-1's copy-in (so before the compute that runs
    while j-1 gathers), and are waited after it, right before their own copy-in."""
    graph = graphs.post[0 if which == "forward" else 1]
    copy_ins = _bucket_copy_ins(graph)
    assert len(copy_ins) >= 3
    for previous, copy_in in itertools.pairwise(copy_ins):
        starts = _feeding_starts(copy_in)
        assert starts, copy_in
        assert all(start < previous for start in starts), (copy_in, previous)
        assert all(previous < wait < copy_in for start in starts for wait in start.users)


def test_gradient_copies_are_waited_after_the_last_compute(graphs):
    """The device-to-host copies start as their gradients are reduced and are all waited at the end."""
    backward = graphs.post[1]
    matmuls = [n for n in backward.nodes if n.target in MATMULS]
    regather = {w for copy_in in _bucket_copy_ins(backward) for s in _feeding_starts(copy_in) for w in s.users}
    copied_out = [w for w in backward.find_nodes(op="call_function", target=COPY_WAIT) if w not in regather]
    assert matmuls
    assert len(copied_out) == N_PARAMS
    assert min(copied_out) > max(matmuls)
    assert any(wait.args[0] < max(matmuls) for wait in copied_out), "early gradients start copying before the end"


@pytest.mark.slow
def test_without_the_passes_each_copy_is_waited_where_it_starts(fake_world8, graphs):
    """Negative control: the traced order (no passes) waits each copy right after its start."""
    forward = _trace(None).post[0]
    starts, _ = _copies(forward)
    assert starts
    assert all(start.next in start.users for start in starts)
    placed, _ = _copies(graphs.post[0])
    assert not all(start.next in start.users for start in placed)


@pytest.mark.slow
def test_under_the_optimizer_tier_the_forward_reads_the_device_copies(fake_world8):
    """`OffloadPolicy(parameters=False)`: no copy in the forward (the gathers read the shards the
    device keeps), every gradient copied out in the backward."""
    torch.manual_seed(0)
    model = simplefsdp.wrap(
        Transformer(ARGS), init_device_mesh("cpu", (8,)), offload=simplefsdp.OffloadPolicy(parameters=False)
    )
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    forward, backward = record_step(model, lambda c: c(tokens).sum(), backend="simplefsdp_aot_eager").post
    assert _copies(forward) == ([], [])
    starts, waits = _copies(backward)
    assert len(starts) == len(waits) == N_PARAMS


def test_the_device_copies_hold_the_masters_in_the_compute_dtype_and_follow_loads(fake_world8):
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = simplefsdp.wrap(
        Transformer(ARGS),
        init_device_mesh("cpu", (8,)),
        mp_policy=policy,
        offload=simplefsdp.OffloadPolicy(parameters=False),
    )

    def copies_match() -> bool:
        return all(torch.equal(device_copy_of(p), p.to_local().to(torch.bfloat16)) for p in model.parameters())

    for param in model.parameters():
        assert param.dtype == torch.float32
        assert device_copy_of(param).dtype == torch.bfloat16
        assert device_copy_of(param).shape == param.to_local().shape
    assert copies_match()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().add_(1.0)  # a write outside the optimizer: the copies go stale
    assert not copies_match()
    model.load_state_dict(state)  # its post-hook refreshes them
    assert copies_match()
