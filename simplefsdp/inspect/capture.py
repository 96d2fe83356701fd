"""Compile a wrapped model for one training step and keep what the compiler made of it.

`capture_step(model, example_input)` runs `loss_fn(compiled(example_input)).backward()` once and
returns the forward and backward post-grad FX graphs as simplefsdp's pass left them (and as they
were before it), plus, when `code=True`, the Python source inductor generated for each. The
graphs are recorded by `record.py`; this module adds what a dry run needs on top: checks of the
model and the input, and the choice of compiler by the model's device.

The graphs are inductor's: `code=True` compiles with inductor (real tensors only) and keeps its
output code; otherwise the capture runs inductor's compile up to its code generation
(decompositions, joint-graph passes, partitioner, post-grad passes with simplefsdp's pass among
them) and then runs the post-grad graphs eagerly, op by op, so meta tensors work (a model built under
`torch.device("meta")`, e.g. a 405B-shaped one: fake tensors all the way, no memory) and no code
is generated. See [Note: why inductor's graphs].

[Note: why inductor's graphs]
The pass decides by room: its reorder delays a reduction's wait, or prefetches a gather, when the
graph's live bytes allow it. Graphs recorded with the `simplefsdp_aot_eager` backend (undecomposed,
aot_eager's partitioner) are not the graphs inductor compiles: on a 4-block Llama-style model at 2
ranks, that backward received 9.3 MiB of saved activations where inductor's received 5.5 MiB, and
the pass, seeing less room, waited every reduce-scatter at once where under inductor it delayed each
past the next re-gather. A dry run on those graphs predicted an order the compiled step does not
run: its FULL_SHARD peak was 17-18% under the measured one on 2 and 4 ranks; on inductor's graphs
(and with the pass's [Note: a reduction starts at its first buffer], without which the meta
graph's attention kernel, laid out differently from the CPU's, still moved the pass's choice) it
is 7% under on both (`bench/inspect_validate.py`).

[Note: attention on the meta device]
On meta, `F.scaled_dot_product_attention` picks the math fallback: it would trace a `[B, H, S, S]`
softmax and save it for backward, which no GPU kernel does (flash / cuDNN attention keep O(S)).
So on meta the Dynamo graph's SDPA calls without a mask are rewritten to
`aten._scaled_dot_product_flash_attention` (meta kernel, autograd formula and FLOP formula all
exist), so the cost and memory models see the kernel a GPU runs. Calls with an explicit mask keep
the math path (that is what a GPU runs for them too, minus the fused memory-efficient kernel).

[Note: no constant folding on the meta device]
Inductor's joint-graph constant folding ends by replacing every meta tensor the joint graph returns
with an empty one (it has no data to keep) and removing what computed it: on meta, the gradients
(and the forward's outputs) came out of the graphs as `empty_strided` nodes, and the backward ended
holding none of them (the dry run's memory view of a 64-rank model said so). So
on meta the capture compiles with `joint_graph_constant_folding` off; on real tensors it stays on,
as inductor runs it.

Invariants: the pass recorded is the model's own `FsdpPass` (the one `wrap()` attached), run
exactly once per graph, between the two records (see [Note: how graphs are recorded]).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import fx, nn

from simplefsdp._compat import compile_front_half, inductor_config, run_post_grad_passes, tree_leaves
from simplefsdp.class_swap import user_class
from simplefsdp.inspect.record import StepGraphs, record_step

__all__ = ["StepCapture", "capture_step", "describe_input", "run_model"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCapture:
    """The graphs of one compiled training step of `model`. `*_pre` are the graphs before simplefsdp's
    pass (equal to the post-pass ones when the model's passes are off); `*_code` is inductor's output
    code, None unless captured with inductor."""

    model: nn.Module
    graphs: StepGraphs
    on_meta: bool = False

    @property
    def forward(self) -> fx.Graph:
        return self.graphs.forward

    @property
    def backward(self) -> fx.Graph:
        return self.graphs.backward

    @property
    def forward_pre(self) -> fx.Graph:
        return self.graphs.forward_pre

    @property
    def backward_pre(self) -> fx.Graph:
        return self.graphs.backward_pre

    @property
    def forward_code(self) -> str | None:
        return self.graphs.code[0] if self.graphs.code else None

    @property
    def backward_code(self) -> str | None:
        return self.graphs.code[1] if self.graphs.code else None

    @property
    def world_size(self) -> int:
        """Size of the data-parallel mesh the parameters are sharded over (1 if none is)."""
        return next((p.device_mesh.size() for p in self.model.parameters() if hasattr(p, "device_mesh")), 1)


def describe_input(example_input: Any) -> str:
    """Shapes and dtypes of every tensor in `example_input`, for error messages."""
    shapes = [f"{tuple(t.shape)} {t.dtype}" for t in tree_leaves(example_input) if isinstance(t, torch.Tensor)]
    return ", ".join(shapes) or repr(example_input)


def run_model(model: nn.Module, example_input: Any) -> Any:
    """`model(*example_input)` for a tuple, `model(**example_input)` for a dict, else `model(example_input)`."""
    if isinstance(example_input, tuple):
        return model(*example_input)
    if isinstance(example_input, dict):
        return model(**example_input)
    return model(example_input)


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating-point tensor in the output (a tensor, a tuple, a Hugging Face `ModelOutput`)."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError(f"the model's output holds no floating-point tensor to take a loss of: {type(output)}")
    return sum(t.float().sum() for t in leaves)


def _check_runs(model: nn.Module, example_input: Any) -> None:
    """A clear error, naming the model and the input, if the model does not run eagerly on the input."""
    try:
        with torch.no_grad():
            run_model(model, example_input)
    except Exception as error:
        raise ValueError(
            f"{user_class(model).__name__} does not run on the example input ({describe_input(example_input)}): "
            f"{type(error).__name__}: {error}"
        ) from error


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped-query attention: each kv head serves a group
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _rewrite_attention(gm: fx.GraphModule) -> int:
    """See [Note: attention on the meta device]; returns how many calls were rewritten. Walks the
    subgraphs too: an activation-checkpointed block reaches the backend as a higher-order op whose
    body is a child GraphModule."""
    rewritten = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        here = 0
        for node in module.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention):
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            if mask is None:
                node.target = _flash_sdpa
                here += 1
        if here:
            module.recompile()
        rewritten += here
    return rewritten


def _post_grad_graph(gm: fx.GraphModule, example_inputs, **kwargs):
    """The `inner_compile` of the capture: inductor's post-grad passes, then the graph itself, run
    eagerly in place of inductor's code."""
    run_post_grad_passes(gm, example_inputs, is_inference=kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm)


def _front_half_backend(gm: fx.GraphModule, example_inputs):
    """See [Note: why inductor's graphs] and, on the meta device, [Note: attention on the meta device]."""
    if not any(t.is_meta for t in example_inputs if isinstance(t, torch.Tensor)):
        return compile_front_half(gm, example_inputs, inner_compile=_post_grad_graph)
    _rewrite_attention(gm)
    with inductor_config.patch(joint_graph_constant_folding=False):
        return compile_front_half(gm, example_inputs, inner_compile=_post_grad_graph)


def capture_step(
    model: nn.Module,
    example_input: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    code: bool = False,
) -> StepCapture:
    """Compile `model` (wrapped by `simplefsdp.wrap`), run one forward + backward on `example_input`
    and return the graphs (see the module docstring). `code=True` compiles with inductor and keeps
    its output code (real tensors only)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture_step() takes an nn.Module, got {type(model).__name__}")
    if not getattr(model, "_simplefsdp_wrapped", False):
        raise ValueError(f"{user_class(model).__name__} is not wrapped: call simplefsdp.wrap(model, mesh) first")
    on_meta = any(t.is_meta for t in tree_leaves(example_input) if isinstance(t, torch.Tensor))
    if on_meta and code:
        raise ValueError("inductor output code needs real tensors; the example input is on the meta device")
    _check_runs(model, example_input)
    backend = "inductor" if code else _front_half_backend
    graphs = record_step(
        model, lambda compiled: loss_fn(run_model(compiled, example_input)), backend=backend, code=code
    )
    logger.info(
        "captured %s: forward %d nodes, backward %d nodes",
        user_class(model).__name__,
        len(graphs.forward.nodes),
        len(graphs.backward.nodes),
    )
    return StepCapture(model=model, graphs=graphs, on_meta=on_meta)
