"""Repeated blocks compiled once as nested compile regions (`simplefsdp/regions.py`).

Graph structure on the fake process group (world 8): one traced body for every block, the
collectives in the step's graphs where the passes bucket and prefetch them as without regions.
Numbers on 2 gloo ranks: a few steps with and without regions are bitwise equal, also with
activation checkpointing, a `no_sync` step and tied / frozen parameters (slow). Tensor-parallel
blocks are not made regions (`regions.install_regions`); `test_tensor_parallel.py` runs them.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import simplefsdp
from simplefsdp import regions
from simplefsdp.inspect.record import record_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import collective_counts, collective_kind
from tests.simplefsdp import _regions as worker

ARGS = TransformerArgs(vocab_size=64, dim=32, n_layers=3, n_heads=2, ffn_dim=64, max_seq_len=16)


def _model(*, compile_regions: bool) -> Transformer:
    torch.manual_seed(0)
    return simplefsdp.wrap(Transformer(ARGS), compile_regions=compile_regions)


def _invocations(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]


def _step(model: Transformer):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    return record_step(model, lambda compiled: compiled(tokens).float().pow(2).mean(), backend="simplefsdp_aot_eager")


def test_blocks_share_one_body_and_the_passes_still_bucket_and_prefetch(fake_world8):
    graphs = _step(_model(compile_regions=True))
    forward, backward = _invocations(graphs.forward), _invocations(graphs.backward)
    assert len(forward) == len(backward) == ARGS.n_layers
    assert len({n.args[1] for n in forward}) == 1, "every block calls one traced forward body"
    assert len({n.args[1] for n in backward}) == 1, "and one backward body"
    torch.compiler.reset()
    plain = _step(_model(compile_regions=False))
    # the collectives stay in the step's graphs, bucketed exactly as without regions
    assert collective_counts(graphs.forward) == collective_counts(plain.forward)
    assert collective_counts(graphs.backward) == collective_counts(plain.backward)
    # prefetch: before block k computes, the gathers of the embedding and of blocks 0..k+1 are launched
    order = list(graphs.forward.nodes)
    for k, call in enumerate(forward[:-1]):
        launched = sum(collective_kind(n) == "all_gather" for n in order[: order.index(call)])
        assert launched >= k + 3, f"block {k + 1}'s gather is not launched before block {k} computes"


def test_a_block_in_another_state_gets_another_key(fake_world8):
    model = _model(compile_regions=True)
    keys = [layer._simplefsdp_region_key for layer in model.layers]
    assert len(set(keys)) == 1, "identical blocks share a key"
    model.layers[1].feed_forward.eval()
    model.layers[2].attention.n_heads = 4  # an attribute the forward reads
    regions.refresh_keys(model)
    keys = [layer._simplefsdp_region_key for layer in model.layers]
    assert len(set(keys)) == 3


def test_regions_are_off_on_request_and_for_the_auto_plan(fake_world8):
    assert not regions.has_regions(_model(compile_regions=False))
    auto = simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="auto"))
    assert not regions.has_regions(simplefsdp.wrap(Transformer(ARGS), passes=auto))
    assert regions.has_regions(_model(compile_regions=True))


@pytest.mark.slow
def test_steps_with_regions_are_bitwise_the_steps_without(ranks2):
    """2 gloo ranks: tied and frozen parameters (the LoRA model), activation checkpointing of every
    block, a `no_sync` step then two synchronized ones."""
    with_regions, without = ranks2.run(worker.losses_and_grads, True), ranks2.run(worker.losses_and_grads, False)
    for (losses, params), (plain_losses, plain_params) in zip(with_regions, without, strict=True):
        assert losses == plain_losses
        assert params.keys() == plain_params.keys()
        for fqn, value in params.items():
            assert torch.equal(value, plain_params[fqn]), fqn
