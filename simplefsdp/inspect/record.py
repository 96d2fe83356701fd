"""Record the post-grad graphs of a compiled training step, before and after a graph pass.

    graphs = record_step(model, lambda compiled: compiled(tokens).sum())   # compiles, runs one step
    graphs.forward, graphs.backward          # as simplefsdp's pass left them
    graphs.forward_pre, graphs.backward_pre  # as traced, before the pass

    with recording(pass_of(model)) as graphs:   # around a compiling call you make yourself
        loss_fn(compiled(batch)).backward()

The one way this project keeps a compiled step's graphs: `simplefsdp inspect` (`capture.py`), the
train command (`simplefsdp/train/loop.py`, for the communication line of `train/comm.py`) and the
tests all use it.

[Note: how graphs are recorded]
Inductor, and the `simplefsdp_aot_eager` debugging backend, run the post-grad passes installed
with `passes/install.py`'s `running(...)` on the partitioned forward and backward graphs. Inside
`recording(graph_pass)` the installed chain is `[GraphRecorder (pre), graph_pass, GraphRecorder
(post), passes configured before]` (an inference-aware pass configured before runs ahead of it,
see `running`). A wrapped model's forward, which installs its own pass while
it compiles, finds its pass in the chain already when `graph_pass` is `pass_of(model)` and adds
nothing. Compile caches are off inside the block, so every compile really happens and every pass
really runs -- unless `caches=True` (`simplefsdp train`'s compile cache), where a graph served from
the caches is not compiled and so not recorded: a step found whole in the caches records nothing,
and the recorders' `uuid()`s key its entries apart from those of unrecorded compiles. The backward
is lowered together with the forward, inside the block. Other backends (`"eager"`, plain
`"aot_eager"`) run no post-grad pass: nothing is recorded.

Invariant: no compiler setting outlives the block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import fx, nn

from simplefsdp._compat import CustomGraphPass, functorch_config, inductor_config, run_and_get_code
from simplefsdp.class_swap import user_class
from simplefsdp.passes.install import pass_of, running

__all__ = ["GraphRecorder", "StepGraphs", "record_step", "recording"]


class GraphRecorder(CustomGraphPass):
    """A post-grad pass that appends a copy of every graph it sees to `graphs` (and changes nothing)."""

    skips_region_bodies = True  # a step's graphs only ([Note: the passes skip region bodies], install.py)

    def __init__(self, tag: str = "simplefsdp-recorder") -> None:
        self.tag = tag
        self.graphs: list[fx.Graph] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs.append(copy.deepcopy(graph))

    def uuid(self) -> str:
        return self.tag


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepGraphs:
    """Post-grad graphs recorded in compile order (a step: its forward, then its backward), after
    (`post`) and before (`pre`) the recorded pass; `code` is inductor's output code when asked for."""

    pre: list[fx.Graph]
    post: list[fx.Graph]
    code: list[str] = dataclasses.field(default_factory=list)

    def _graph(self, graphs: list[fx.Graph], index: int, what: str) -> fx.Graph:
        if len(graphs) <= index:
            raise RuntimeError(f"no {what} graph was recorded ({len(graphs)} graphs): did the compile run a pass?")
        return graphs[index]

    @property
    def forward(self) -> fx.Graph:
        return self._graph(self.post, 0, "forward")

    @property
    def backward(self) -> fx.Graph:
        return self._graph(self.post, 1, "backward")

    @property
    def forward_pre(self) -> fx.Graph:
        return self._graph(self.pre, 0, "forward")

    @property
    def backward_pre(self) -> fx.Graph:
        return self._graph(self.pre, 1, "backward")

    def saved_for_backward(self, *, pre: bool = False) -> list[fx.Node]:
        """Nodes the forward graph returns: the user outputs followed by what it saves for backward."""
        graph = self.forward_pre if pre else self.forward
        (outputs,) = graph.find_nodes(op="output")[0].args
        return [node for node in outputs if isinstance(node, fx.Node)]


@contextlib.contextmanager
def recording(graph_pass: CustomGraphPass | None = None, *, caches: bool = False) -> Iterator[StepGraphs]:
    """Compiles inside the block record their post-grad graphs before and after `graph_pass` (None:
    no pass, and one record serves as both: `pre` and `post` are the same graphs, to be read, not
    changed); `caches`: the compile caches stay as configured (a hit records nothing); see [Note:
    how graphs are recorded]."""
    pre, post = GraphRecorder("simplefsdp-record-pre"), GraphRecorder("simplefsdp-record-post")
    uncached = {} if caches else {"enable_autograd_cache": False}
    with (
        running([pre] if graph_pass is None else [pre, graph_pass, post]),
        inductor_config.patch({} if caches else {"fx_graph_cache": False}),
        functorch_config.patch(force_non_lazy_backward_lowering=True, **uncached),
    ):
        yield StepGraphs(pre=pre.graphs, post=pre.graphs if graph_pass is None else post.graphs)


def record_step(
    model: nn.Module,
    loss_of: Callable[[nn.Module], torch.Tensor],
    *,
    backend: str | Callable = "inductor",
    graph_pass: CustomGraphPass | None = None,
    code: bool = False,
) -> StepGraphs:
    """Compile `model` (`fullgraph=True`, `backend`), run `loss_of(compiled).backward()` once while
    recording, and return its forward and backward graphs. The pass recorded is `graph_pass`, by
    default the one `simplefsdp.wrap()` attached to `model` (none if its passes are off).
    `code=True` also keeps inductor's output code (inductor only)."""
    if graph_pass is None:
        graph_pass = pass_of(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step() -> None:
        loss_of(compiled).backward()

    with recording(graph_pass) as graphs:
        if code:
            _, sources = run_and_get_code(step)
            graphs.code.extend(sources)
        else:
            step()
    if len(graphs.post) != 2:
        raise RuntimeError(
            f"expected a forward and a backward graph from compiling {user_class(model).__name__}, got "
            f"{len(graphs.post)} (compiled already in this process? torch.compiler.reset() clears Dynamo's "
            "cache; a backend that runs no post-grad pass records nothing)"
        )
    if code and len(graphs.code) != 2:
        raise RuntimeError(f"expected inductor code for a forward and a backward, got {len(graphs.code)} modules")
    return graphs
