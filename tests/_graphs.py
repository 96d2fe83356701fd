"""Capture the forward and backward FX graphs torch.compile produces for one training step.

Uses aot_autograd with inductor's partitioner (min-cut rematerialisation), so what is saved
for backward and what is recomputed is what inductor would see; the graphs then run eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import fx

from simplefsdp._compat import (
    CustomGraphPass,
    aot_autograd,
    functorch_config,
    inductor_config,
    min_cut_rematerialization_partition,
)


@dataclasses.dataclass
class StepGraphs:
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None

    def saved_for_backward(self) -> list[fx.Node]:
        """Nodes the forward returns, i.e. the user outputs followed by what it saves for backward."""
        (outputs,) = self.forward.graph.find_nodes(op="output")[0].args
        return [node for node in outputs if isinstance(node, fx.Node)]


def capture_step(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> StepGraphs:
    """Compile `model`, run `loss_of(compiled).backward()` once, and return the two graphs."""
    graphs = StepGraphs()

    def keep(kind: str):
        def compiler(gm: fx.GraphModule, example_inputs):
            setattr(graphs, kind, gm)
            return gm

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition
    )
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss_of(compiled).backward()
    assert graphs.forward is not None, "torch.compile produced no forward graph"
    assert graphs.backward is not None, "torch.compile produced no backward graph"
    return graphs


class _KeepPostGrad(CustomGraphPass):
    """Runs `before` (if any), then records every post-grad graph (forward, then backward)."""

    def __init__(self, before: CustomGraphPass | None) -> None:
        self.before = before
        self.graphs: list[fx.Graph] = []

    def __call__(self, graph: fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        self.graphs.append(copy.deepcopy(graph))

    def uuid(self) -> str:
        return "tests-keep-post-grad"


def capture_post_grad(
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    *,
    before: CustomGraphPass | None = None,
) -> list[fx.Graph]:
    """Compile `model` with inductor, run one step, and return the post-grad graphs `[forward, backward]`
    (after running the pass `before` on them, if given).

    Config is patched only for this compile: no compile caches (so the pass really runs) and the
    backward lowered together with the forward (inside the patch, not lazily at `.backward()`).
    """
    keep = _KeepPostGrad(before)
    with (
        inductor_config.patch(post_grad_custom_post_pass=keep, fx_graph_cache=False),
        functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False),
    ):
        loss_of(torch.compile(model, backend="inductor", fullgraph=True)).backward()
    return keep.graphs


@contextlib.contextmanager
def post_grad_pass(graph_pass: CustomGraphPass):
    """Run `graph_pass` on the post-grad graphs of compiles inside the block (forward and backward).

    Compile caches are off inside the block, so the pass really runs (a cache hit would return a
    graph compiled earlier with the pass, without calling it).
    """
    with (
        inductor_config.patch(post_grad_custom_post_pass=graph_pass, fx_graph_cache=False),
        functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False),
    ):
        yield
