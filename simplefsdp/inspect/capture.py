"""Compile a wrapped model for one training step and keep what the compiler made of it.

`capture_step(model, example_input)` runs `loss_fn(compiled(example_input)).backward()` once and
returns the forward and backward post-grad FX graphs as simplefsdp's pass left them (and as they
were before it), plus, when `code=True`, the Python source inductor generated for each.

Two ways to compile, picked by the model's device:

- real tensors (a small model on the CPU): inductor when `code=True`, else the
  `simplefsdp_aot_eager` backend; the step really runs (on the fake process group the
  collectives move no data, which is fine: only the graphs matter);
- meta tensors (a model built under `torch.device("meta")`, e.g. a 405B-shaped one): the
  `simplefsdp_aot_eager` path with fake tensors all the way, no memory, no inductor; the graphs
  are the same partitioned post-grad graphs the passes see, before inductor's lowering.

[Note: attention on the meta device]
On meta, `F.scaled_dot_product_attention` picks the math fallback: it would trace a `[B, H, S, S]`
softmax and save it for backward, which no GPU kernel does (flash / cuDNN attention keep O(S)).
So on meta the Dynamo graph's SDPA calls without a mask are rewritten to
`aten._scaled_dot_product_flash_attention` (meta kernel, autograd formula and FLOP formula all
exist), so the cost and memory models see the kernel a GPU runs. Calls with an explicit mask keep
the math path (that is what a GPU runs for them too, minus the fused memory-efficient kernel).

Invariants: the pass recorded is the model's own `FsdpPass` (the one `wrap()` installed), run
exactly once per graph, between the two snapshots; compile caches are off inside the capture so
the pass really runs; no compiler config outlives the call.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from simplefsdp._compat import CustomGraphPass, functorch_config, inductor_config, run_and_get_code, tree_leaves
from simplefsdp.passes.aot_eager import BACKEND_NAME
from simplefsdp.passes.aot_eager import backend as aot_eager_backend
from simplefsdp.passes.install import ChainedPass, configured_passes, pass_of

__all__ = ["StepCapture", "capture_step", "describe_input", "recording", "run_model"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCapture:
    """The graphs of one compiled training step. `*_pre` are the graphs before simplefsdp's pass
    (equal to the post-pass ones when the model's passes are off); `*_code` is inductor's output
    code, None unless captured with inductor."""

    model: nn.Module
    forward: fx.Graph
    backward: fx.Graph
    forward_pre: fx.Graph
    backward_pre: fx.Graph
    forward_code: str | None = None
    backward_code: str | None = None
    on_meta: bool = False

    @property
    def world_size(self) -> int:
        """Size of the data-parallel mesh the parameters are sharded over (1 if none is)."""
        return next((p.device_mesh.size() for p in self.model.parameters() if hasattr(p, "device_mesh")), 1)


class _Snapshot(CustomGraphPass):
    """A post-grad pass that only copies the graph it sees into `into`."""

    def __init__(self, into: list[fx.Graph], tag: str) -> None:
        self.into, self.tag = into, tag

    def __call__(self, graph: fx.Graph) -> None:
        self.into.append(copy.deepcopy(graph))

    def uuid(self) -> str:
        return f"simplefsdp-inspect-{self.tag}"


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
            f"{type(model).__name__} does not run on the example input ({describe_input(example_input)}): "
            f"{type(error).__name__}: {error}"
        ) from error


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped-query attention: each kv head serves a group
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _rewrite_attention(gm: fx.GraphModule) -> int:
    """See [Note: attention on the meta device]; returns how many calls were rewritten."""
    rewritten = 0
    for node in gm.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention):
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if mask is None:
            node.target = _flash_sdpa
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _meta_backend(gm: fx.GraphModule, example_inputs):
    _rewrite_attention(gm)
    return aot_eager_backend(gm, example_inputs)


@contextlib.contextmanager
def recording(model: nn.Module, pre: list[fx.Graph], post: list[fx.Graph]) -> Iterator[None]:
    """Compiles inside run `[snapshot, model's pass, snapshot, passes already configured]`.

    The chain holds the model's pass, so the wrapped forward (`passes/install.py`) sees it
    installed already and adds only its other settings.
    """
    ours = pass_of(model)
    chain = [_Snapshot(pre, "pre"), *([ours] if ours is not None else []), _Snapshot(post, "post")]
    chain += list(configured_passes(inductor_config.post_grad_custom_post_pass))
    with (
        inductor_config.patch(post_grad_custom_post_pass=ChainedPass(chain), fx_graph_cache=False),
        functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False),
    ):
        yield


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
        raise ValueError(f"{type(model).__name__} is not wrapped: call simplefsdp.wrap(model, mesh) first")
    on_meta = any(t.is_meta for t in tree_leaves(example_input) if isinstance(t, torch.Tensor))
    if on_meta and code:
        raise ValueError("inductor output code needs real tensors; the example input is on the meta device")
    _check_runs(model, example_input)
    backend = _meta_backend if on_meta else ("inductor" if code else BACKEND_NAME)
    pre: list[fx.Graph] = []
    post: list[fx.Graph] = []
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step() -> None:
        loss_fn(run_model(compiled, example_input)).backward()

    with recording(model, pre, post):
        if code:
            _, sources = run_and_get_code(step)
        else:
            step()
            sources = [None, None]
    if len(post) != 2:
        raise RuntimeError(
            f"expected a forward and a backward graph from compiling {type(model).__name__}, got {len(post)} "
            "(was it compiled already in this process? torch.compiler.reset() clears Dynamo's cache)"
        )
    if code and len(sources) != 2:
        raise RuntimeError(f"expected inductor code for a forward and a backward, got {len(sources)} modules")
    logger.info("captured %s: forward %d nodes, backward %d nodes", type(model).__name__, *(len(g.nodes) for g in post))
    return StepCapture(
        model=model,
        forward=post[0],
        backward=post[1],
        forward_pre=pre[0],
        backward_pre=pre[1],
        forward_code=sources[0],
        backward_code=sources[1],
        on_meta=on_meta,
    )
