"""`passes/uneven.py`: DTensor's split + pad + concatenation of an uneven gradient becomes one pad.

The graphs are traced with make_fx from DTensor's own padding (`Shard._split_tensor`), so the
pattern is the one the compiled backward holds; the folded graph must give bitwise the same tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp._compat import c10d_functional as c10d
from simplefsdp.passes.uneven import fold_padded_split, fold_uneven_reductions

aten = torch.ops.aten


def _padded_for_world(world: int):
    def padded(grad: torch.Tensor) -> torch.Tensor:
        pieces, _ = Shard(0)._split_tensor(grad, world, with_padding=True, contiguous=True)
        return torch.cat(pieces)

    return padded


def _cats(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=aten.cat.default))


@pytest.mark.parametrize(
    ("shape", "world"),
    [
        ((100, 8), 16),  # chunk 7: 14 full chunks, one of 2 rows padded, one empty rank
        ((10, 3), 4),  # chunk 3: the last rank's 1 row padded, no empty rank
        ((3,), 8),  # chunk 1: five ranks hold nothing
        ((67, 2, 2), 64),  # the transformer vocabulary at 64 ranks
    ],
)
def test_the_padded_concatenation_becomes_one_pad(shape, world):
    padded = _padded_for_world(world)
    gm = make_fx(padded, tracing_mode="fake")(torch.empty(shape))
    (cat,) = _cats(gm)
    node = fold_padded_split(gm.graph, cat)
    assert node is not None
    assert node.target is aten.constant_pad_nd.default
    gm.graph.lint()
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets == {aten.constant_pad_nd.default}, f"the split, its pieces and pads are gone: {targets}"
    grad = torch.randn(shape)
    want = padded(grad)
    got = gm(grad)
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert torch.equal(got, want)


def _traced(fn, *shapes) -> tuple[fx.GraphModule, fx.Node]:
    gm = make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes))
    (cat,) = _cats(gm)
    return gm, cat


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda g: torch.cat([*reversed(torch.split(g, 3))]), id="chunks out of order"),
        pytest.param(lambda g: torch.cat(torch.split(g, 3)[:-1]), id="a chunk missing"),
        pytest.param(
            lambda g: torch.cat([F.pad(c, (0, 0, 0, 1)) for c in torch.split(g, 3)]), id="a middle chunk padded"
        ),
        pytest.param(
            lambda g: torch.cat([*torch.split(g, 3)[:-1], F.pad(torch.split(g, 3)[-1], (0, 0, 0, 2), value=1.0)]),
            id="padded with ones",
        ),
        pytest.param(
            lambda g: torch.cat([*torch.split(g, 3)[:-1], F.pad(torch.split(g, 3)[-1], (0, 0, 2, 0))]),
            id="zeros before the last rows",
        ),
        pytest.param(lambda g: torch.cat(torch.split(g, 2, dim=1), dim=0), id="split on another dim"),
    ],
)
def test_other_concatenations_stay(fn):
    gm, cat = _traced(fn, (10, 4))
    before = str(gm.graph)
    assert fold_padded_split(gm.graph, cat) is None
    assert str(gm.graph) == before, "a refused fold leaves the graph as it was"


@pytest.mark.parametrize("cast", [False, True], ids=["direct", "through a cast"])
def test_only_concatenations_read_by_reduce_scatters_are_folded(cast):
    """Mixed precision casts the padded gradient to the reduce dtype between the concatenation and
    the reduce-scatter; a concatenation the graph returns is not ours to rewrite."""
    padded = _padded_for_world(4)
    gm = make_fx(lambda g, h: (padded(g), padded(h)), tracing_mode="fake")(torch.empty(10, 3), torch.empty(10, 3))
    scattered, kept = _cats(gm)
    g = gm.graph
    sent = scattered
    with scattered.meta["val"].fake_mode:
        if cast:
            with g.inserting_after(scattered):
                sent = g.call_function(torch.ops.prims.convert_element_type.default, (scattered, torch.bfloat16))
            sent.meta["val"] = scattered.meta["val"].to(torch.bfloat16)
        with g.inserting_after(sent):
            launch = g.call_function(c10d.reduce_scatter_tensor.default, (sent, "avg", 4, "0"))
        launch.meta["val"] = c10d.reduce_scatter_tensor.default(sent.meta["val"], "avg", 4, "0")
    (output,) = g.find_nodes(op="output")
    output.args = ((launch, kept),)
    assert fold_uneven_reductions(g) == 1
    g.lint()
    pad = launch.args[0].args[0] if cast else launch.args[0]
    assert pad.target is aten.constant_pad_nd.default
    assert _cats(gm) == [kept], "a concatenation the graph returns stays"
    assert fold_uneven_reductions(g) == 0


def test_a_recorded_step_is_folded_before_partitioning_even_with_the_pass_off():
    """`running` folds on the joint graph: a step recorded with the pass off (as the advisor traces)
    already holds one pad per uneven gradient where DTensor concatenated 16 pieces."""
    from torch import nn

    import simplefsdp
    from simplefsdp.inspect import capture_step, fake_world, make_mesh
    from simplefsdp.passes.collectives import find_collectives

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj = nn.Embedding(100, 8), nn.Linear(8, 8)  # 100 and 8 rows over 16 ranks

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.proj(self.embed(tokens))

    with fake_world(16):
        with torch.device("meta"):
            model = Tiny()
        simplefsdp.wrap(model, make_mesh(strategy="FULL_SHARD", world_size=16), passes=None)
        capture = capture_step(model, torch.zeros(2, 4, dtype=torch.long, device="meta"))
    backward = capture.graphs.backward_pre
    sent = [c.launch.args[0] for c in find_collectives(backward, kinds=["reduce_scatter"])]
    assert len(sent) == 3, "the embedding, the weight and the bias: all uneven over 16 ranks"
    assert [s.target for s in sent] == [aten.constant_pad_nd.default] * 3
    assert not backward.find_nodes(op="call_function", target=aten.cat.default), "no concatenation left"
