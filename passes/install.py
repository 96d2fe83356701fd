"""Run a wrapped model's `FsdpPass` whenever torch.compile compiles that model, and only then.

[Note: how a plain `torch.compile(model)` picks up the pass]
Inductor runs the pass found in `torch._inductor.config.post_grad_custom_post_pass` when it
compiles a graph. `attach_pass()` gives the wrapped root module a subclass whose `forward` sets that
config (chained with whatever pass is already there) for the duration of the call and then runs
the original `forward`. That `forward` is wrapped with `_compat.eager_top_frame`: Dynamo runs it
eagerly when it is the top frame (`torch.compile(model)`, `model.compile()`) and compiles the
entry function it calls, which inlines the original `forward`, inside the patched config; when it
is called from a frame Dynamo is already tracing, Dynamo traces straight through it (no graph
break). The backward is lowered together with the forward (`force_non_lazy_backward_lowering`),
inside the patch, instead of lazily at `.backward()`.
Consequences:
- unrelated compiles never see the pass: the config is restored when the call returns;
- the compile caches stay correct: the pass's `uuid()` (its config, groups and this process's
  rank, see [Note: the rank is part of the cache key]) is part of the key, and its decisions
  depend only on the graph, which is keyed already;
- a pass the user set globally or with `config.patch` runs too, after ours, on the graph ours
  produced (`ChainedPass`); a pass passed as `torch.compile(..., options=...)` is applied by
  inductor *inside* our patch and replaces ours -- chain it yourself (`ChainedPass`) or set it
  with `config.patch`;
- when the model is called from inside a larger compiled function (`torch.compile(train_step)`),
  the config is already fixed by the time Dynamo reaches the model; the wrapper then does
  nothing, and `active(model)` around the compiled call is the way to apply the pass. Without it,
  the first such trace warns once (`_inactive_check`): the graphs compile with no bucketing and no
  reordering, which is correct but slow, and was silent.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import types
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import fx, nn

from simplefsdp._compat import (
    CustomGraphPass,
    CustomInferenceAwareGraphPass,
    eager_top_frame,
    functorch_config,
    inductor_config,
)
from simplefsdp.class_swap import subclass
from simplefsdp.passes.fsdp_pass import FsdpPass

__all__ = ["ChainedPass", "active", "attach_pass", "chained_with", "configured_passes", "pass_of"]

_PASS_ATTR = "_simplefsdp_pass"


def _takes_is_inference(graph_pass: object) -> bool:
    return CustomInferenceAwareGraphPass is not None and isinstance(graph_pass, CustomInferenceAwareGraphPass)


class ChainedPass(CustomInferenceAwareGraphPass or CustomGraphPass):
    """Runs several post-grad passes in order; cacheable only if every one of them is.

    Inference-aware members get the `is_inference` flag inductor passes to the chain.
    """

    def __init__(self, passes: Sequence[object]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        for graph_pass in self.passes:
            if _takes_is_inference(graph_pass):
                graph_pass(graph, is_inference=is_inference)
            else:
                graph_pass(graph)

    def uuid(self) -> str | None:
        uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        if not all(uuids):
            return None  # a plain callable cannot key the cache: inductor then bypasses it, as for the callable alone
        return hashlib.sha256("|".join(map(str, uuids)).encode()).hexdigest()


def configured_passes(current: object) -> tuple[object, ...]:
    """The passes a `post_grad_custom_post_pass` setting holds, in order: none, one, a list or a `ChainedPass`."""
    if current is None:
        return ()
    if isinstance(current, (list, tuple)):
        return tuple(current)
    if isinstance(current, ChainedPass):
        return current.passes
    return (current,)


def chained_with(ours: FsdpPass, current: object) -> CustomGraphPass:
    """The setting that runs `ours` first, then the passes `current` holds (`current` itself if it
    already holds `ours`: a nested call of the same model)."""
    existing = configured_passes(current)
    if any(p is ours for p in existing):
        return current  # nested call of the same model: already installed
    return ChainedPass((ours, *existing)) if existing else ours


def pass_of(model: nn.Module) -> FsdpPass | None:
    """The pass `attach_pass()` attached to `model` (None if passes are off or `model` is not a wrapped root)."""
    return getattr(model, _PASS_ATTR, None)


@contextlib.contextmanager
def active(model: nn.Module) -> Iterator[FsdpPass | None]:
    """Inside the block, compiles run `model`'s pass (chained with any pass already configured).

    Needed only when the model is compiled as part of a larger function; `torch.compile(model)`
    applies it by itself. A no-op if the model's passes are off.
    """
    graph_pass = pass_of(model)
    if graph_pass is None:
        yield None
        return
    patch = {"post_grad_custom_post_pass": chained_with(graph_pass, inductor_config.post_grad_custom_post_pass)}
    if graph_pass.config.reorder is not None:
        # Inductor's peak-memory reordering sinks each all-gather back to its wait (visible in the
        # generated code on torch 2.13), undoing the prefetch; the pass bounds its extra memory itself.
        patch["reorder_for_peak_memory"] = False
    with inductor_config.patch(patch), functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield graph_pass


# [Note: nothing traceable in the eager wrapper]
# While the wrapper runs eagerly, Dynamo's frame callback is still set: every Python frame it calls
# (a contextlib helper, our own functions) would be compiled -- and with fullgraph=True fail. So it
# calls only `torch.compiler.is_compiling()` and the two fully disabled functions below.
@torch.compiler.disable
def _enter(model: nn.Module) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(active(model))
    return stack


@torch.compiler.disable
def _leave(stack: contextlib.ExitStack) -> None:
    stack.close()


# [Note: one compiled-code cache per pass configuration]
# Dynamo caches compiled frames on the code object of the function it compiles, and its guards do
# not look at inductor's config. Two models of one class wrapped with different passes (or one
# with passes off) would therefore run each other's graphs: the second model's compile is a cache
# hit and its pass never runs. So the frame Dynamo compiles is an entry function with its own code
# object per pass configuration (same code, a distinct object): models whose passes agree share
# compiled code, models whose passes differ do not.
#
# [Note: the compiled frame is ours, not the model's forward]
# That entry function lives here and calls the model's own `forward`, which Dynamo inlines. Were the
# model's `forward` itself the frame, a root whose `forward` is torch's (an `nn.Sequential`) would
# not be compiled at all -- Dynamo does not start frames in torch's own files -- and every
# parameter's gather would become a graph of its own, the layers running eagerly in between.
def _fresh_code(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own (same code, defaults, closure and names)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    return copy


def _inactive_check(cls: type[nn.Module], pass_key: str) -> Callable[[], bool]:
    """A check, run by Dynamo once per trace (its result is a constant of the graph), that warns
    the first time a model of `cls` whose pass is keyed `pass_key` is traced inside a larger
    compiled function without that pass configured."""
    warned = False

    @torch.compiler.assume_constant_result
    def check() -> bool:
        nonlocal warned
        current = configured_passes(inductor_config.post_grad_custom_post_pass)
        configured = any(isinstance(p, FsdpPass) and p.uuid() == pass_key for p in current)
        if not configured and not warned:
            warned = True
            warnings.warn(
                f"simplefsdp: a wrapped {cls.__name__} is being compiled inside a larger compiled function, "
                "where simplefsdp's graph passes (bucketing, reordering) do not run by themselves; the "
                "graphs will be correct but unbucketed. Call the compiled function inside "
                "`with simplefsdp.passes.install.active(model):`, or compile the model itself.",
                UserWarning,
                stacklevel=2,
            )
        return configured

    return check


@functools.cache
def _compiling_class(cls: type[nn.Module], pass_key: str) -> type[nn.Module]:
    """`cls` with a `forward` that runs under the pass keyed `pass_key` (its `uuid()`), named
    `PassOnCompile[<cls>]` so a traceback or `repr` says what was added."""
    original_forward = cls.forward

    def compiled_entry(self, *args, **kwargs):
        return original_forward(self, *args, **kwargs)

    entry = _fresh_code(compiled_entry)
    check_configured = _inactive_check(cls, pass_key)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # inlined into a larger compiled function, see the module note
            check_configured()
            return original_forward(self, *args, **kwargs)
        stack = _enter(self)
        try:
            return entry(self, *args, **kwargs)
        finally:
            _leave(stack)

    forward.__doc__ = original_forward.__doc__
    # what `inspect.signature` reports: the original's, for callers that read it (Hugging Face's
    # Trainer keeps only the dataset columns the model's `forward` names)
    forward.__signature__ = inspect.signature(original_forward)
    return subclass(
        cls, adds="PassOnCompile", attrs={"forward": eager_top_frame(forward), "__module__": cls.__module__}
    )


def attach_pass(model: nn.Module, graph_pass: FsdpPass | None) -> None:
    """Attach `graph_pass` to the wrapped root `model` so its compiles run it (None: passes off)."""
    setattr(model, _PASS_ATTR, graph_pass)
    if graph_pass is not None:
        model.__class__ = _compiling_class(type(model), graph_pass.uuid())
