"""Capture the forward and backward FX graphs torch.compile produces for one training step.

Uses aot_autograd with inductor's partitioner (min-cut rematerialisation), so what is saved
for backward and what is recomputed is what inductor would see; the graphs then run eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import fx

from simplefsdp._compat import aot_autograd, min_cut_rematerialization_partition


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
