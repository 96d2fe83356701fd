"""Run a wrapped model's `FsdpPass` whenever torch.compile compiles that model, and only then.

[Note: how a plain `torch.compile(model)` picks up the pass]
Inductor runs the passes installed with `running(...)` when it compiles a graph (see [Note: where
the pass runs]). `attach_pass()` gives the wrapped root module a subclass whose `forward` installs
its pass (chained with whatever pass is already configured) for the duration of the call and then
runs the original `forward`. That `forward` is wrapped with `_compat.eager_top_frame`: Dynamo runs it
eagerly when it is the top frame (`torch.compile(model)`, `model.compile()`) and compiles the
entry function it calls, which inlines the original `forward`, inside the installed passes; when it
is called from a frame Dynamo is already tracing, Dynamo traces straight through it (no graph
break). The backward is lowered together with the forward (`force_non_lazy_backward_lowering`),
inside the block, instead of lazily at `.backward()`.

[Note: where the pass runs]
Inductor's post-grad passes end with a fake-tensor update: every node whose target or arguments
changed since they began is re-run on fake tensors, and so is every user of a node whose new value
differs -- which a fresh output with view users always does, so one changed node re-runs the graph
below it. A pass in `post_grad_custom_post_pass` runs before that update: bucketing there (new
copy-out nodes feeding every block's weights) re-ran nearly every node of both graphs (3,059 of
3,647 forward and 5,283 of 6,722 backward nodes at 32 blocks), then inductor's re-inplacing update
re-ran 4,293 more: 11.0 s of fake-tensor updates per compile against 2.9 s without the pass (one
measurement of each). Inductor's per-device backend passes run after that update, so there the
pass is installed (`_compat.backend_graph_passes`, one entry per device type, the chain run once
per graph): 8,342 nodes in 4.1 s (`bench/compile_time.py`). The re-run left is the re-inplacing
update's, which re-runs what changed since the first update -- the pass's nodes -- as it does for
torch's own FX bucketing, which runs at the same point. The pass's new nodes carry fake values
computed as they are made, so nothing between the pass and that update reads stale metadata.
Passes the user configured in `post_grad_custom_post_pass` move into the same chain, after ours,
for the duration of the block (the slot itself is cleared meanwhile), so they still see the graph
ours produced -- except an inference-aware pass, which needs the `is_inference` flag only that slot
passes: it stays, and runs before ours. Where torch has no backend passes, the chain goes in
`post_grad_custom_post_pass`.

The same block gives the DTensors of the model's meshes per-rank compile-cache keys ([Note: per-rank
AOTAutograd cache keys for DTensor inputs] in `_compat.py`), also with the passes off (a root
without a pass gets the same eager wrapper, named `CompileScope[...]`, and enters that alone).

Consequences:
- unrelated compiles never see the pass, nor the per-rank keys: both end when the call returns;
- the compile caches stay correct: the pass's `uuid()` (its config, groups and code, not the
  rank, see [Note: the rank is not part of the cache key]) is part of the key, and its decisions
  depend only on the graph, which is keyed already;
- a `post_grad_custom_post_pass` the user set globally or with `config.patch` runs too, after
  ours, on the graph ours produced (`ChainedPass`); one passed as `torch.compile(...,
  options=...)` is applied by inductor *inside* our block and runs before ours, on the graph as
  traced;
- when the model is called from inside a larger compiled function (`torch.compile(train_step)`),
  the config is already fixed by the time Dynamo reaches the model; the wrapper then does
  nothing, and `compile_scope(model)` around the compiled call is the way to apply the pass. Without it,
  the first such trace warns once (`_inactive_check`): the graphs compile with no bucketing and no
  reordering, which is correct but slow.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import fx, nn

from simplefsdp._compat import (
    CustomGraphModulePass,
    CustomGraphPass,
    CustomInferenceAwareGraphPass,
    backend_graph_passes,
    checkpoint_side_effects_once,
    eager_top_frame,
    functorch_config,
    inductor_config,
    init_backend_registration,
    is_region_body,
    rank_aware_cache_keys,
    region_compiles,
)
from simplefsdp.activation_checkpoint import has_checkpointed_blocks
from simplefsdp.class_swap import subclass
from simplefsdp.passes.fsdp_pass import FsdpPass, code_fingerprint
from simplefsdp.passes.region_inputs import ForwardRegionInputs, note_region_bodies
from simplefsdp.passes.uneven import fold_uneven_reductions
from simplefsdp.regions import has_regions, refresh_keys

__all__ = [
    "ChainedPass",
    "FoldUnevenPadding",
    "attach_pass",
    "compile_scope",
    "configured_passes",
    "installed",
    "pass_of",
    "running",
]

_PASS_ATTR = "_simplefsdp_pass"
_MESHES_ATTR = "_simplefsdp_cache_key_meshes"  # the meshes of the wrapped root's sharded parameters


def _takes_is_inference(graph_pass: object) -> bool:
    return CustomInferenceAwareGraphPass is not None and isinstance(graph_pass, CustomInferenceAwareGraphPass)


class ChainedPass(CustomInferenceAwareGraphPass or CustomGraphPass):
    """Runs several post-grad passes in order; cacheable only if every one of them is.

    Inference-aware members get the `is_inference` flag inductor passes to the chain.
    """

    def __init__(self, passes: Sequence[object]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        # [Note: the passes skip region bodies]
        # Inductor runs the post-grad passes on each invoke_subgraph body (a block compiled as a
        # nested region, `simplefsdp/regions.py`) before the graph that calls it. A body holds no
        # collective of the model's (they stay in the calling graph), and it is not a step's graph:
        # simplefsdp's own passes (those with `skips_region_bodies`) leave it alone, so the pass sees,
        # and a recording keeps, exactly the step's forward and backward; other passes run on it.
        body = is_region_body(graph.owning_module)
        if not body:
            note_region_bodies(graph)
        for graph_pass in self.passes:
            if body and getattr(graph_pass, "skips_region_bodies", False):
                continue
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
    """The passes a pass setting (`post_grad_custom_post_pass`, `joint_custom_pre_pass`) holds, in order:
    none, one, a list or a `ChainedPass`."""
    if current is None:
        return ()
    if isinstance(current, (list, tuple)):
        return tuple(current)
    if isinstance(current, ChainedPass):
        return current.passes
    return (current,)


# device types the chain is installed for (it runs once per graph); "meta": the dry run runs
# inductor's post-grad passes on meta-device models (simplefsdp/inspect/capture.py)
_DEVICES = ("cpu", "cuda", "xpu", "meta")


class _AfterFakeUpdate(CustomGraphModulePass):
    """One device's backend-pass entry: runs `chain` on a graph (once, whichever of its devices'
    entries comes first), then the entry it displaced (`then`), see [Note: where the pass runs]."""

    def __init__(self, chain: ChainedPass, then: object | None) -> None:
        self.chain, self.then = chain, then

    def __call__(self, gm: fx.GraphModule) -> None:
        ran = gm.meta.setdefault("simplefsdp_chains_run", set())
        if id(self.chain) not in ran:
            ran.add(id(self.chain))
            self.chain(gm.graph)
        if self.then is not None:
            self.then(gm)

    def uuid(self) -> str | None:
        keys = [self.chain.uuid(), None if self.then is None else self.then.uuid()]
        if keys[0] is None or (self.then is not None and keys[1] is None):
            return None
        return hashlib.sha256(repr(keys).encode()).hexdigest()


def _backend_chain() -> tuple[object, ...]:
    """The passes `running` has installed after the fake-tensor update (none outside its blocks)."""
    entry = backend_graph_passes.get(_DEVICES[0]) if backend_graph_passes is not None else None
    return entry.chain.passes if isinstance(entry, _AfterFakeUpdate) else ()


def installed() -> tuple[object, ...]:
    """The post-grad passes inductor would run on a graph compiled now, in the order it runs them:
    what `post_grad_custom_post_pass` holds, then the chain installed by `running` (if any)."""
    return (*configured_passes(inductor_config.post_grad_custom_post_pass), *_backend_chain())


class FoldUnevenPadding(CustomGraphPass):
    """The joint-graph pass `running` installs ahead of any the user configured: DTensor's padding of
    uneven gradients folded into one pad before inductor partitions the joint graph (see [Note: why
    fold the uneven padding] in `uneven.py`; `FsdpPass` folds too, for backends without joint-graph
    passes, where it finds nothing left here)."""

    def __call__(self, graph: fx.Graph) -> None:
        fold_uneven_reductions(graph)

    def uuid(self) -> str:
        return hashlib.sha256(f"simplefsdp-fold-uneven-{code_fingerprint()}".encode()).hexdigest()


def _with_fold(current: object) -> ChainedPass:
    """`joint_custom_pre_pass` set to a `FoldUnevenPadding`, then the passes `current` holds (once)."""
    configured = configured_passes(current)
    if any(isinstance(p, FoldUnevenPadding) for p in configured):
        return ChainedPass(configured)
    return ChainedPass((FoldUnevenPadding(), *configured))


@contextlib.contextmanager
def running(passes: Sequence[object]) -> Iterator[None]:
    """Inside the block, inductor runs `passes`, then the passes configured until now, on every graph
    it compiles, after its fake-tensor update ([Note: where the pass runs]), and `FoldUnevenPadding`
    on the joint graph; the slots are restored on exit. Nested blocks chain: the inner block's passes
    run first, then the outer's. A configured pass that takes inductor's `is_inference` flag stays in
    `post_grad_custom_post_pass` (the backend slot does not get the flag), so it runs before ours."""
    with inductor_config.patch(joint_custom_pre_pass=_with_fold(inductor_config.joint_custom_pre_pass)):
        yield from _running_post_grad(passes)


def _running_post_grad(passes: Sequence[object]) -> Iterator[None]:
    user = configured_passes(inductor_config.post_grad_custom_post_pass)
    if backend_graph_passes is None:
        with inductor_config.patch(post_grad_custom_post_pass=ChainedPass((*passes, *user))):
            yield
        return
    stays = tuple(p for p in user if _takes_is_inference(p))
    chain = ChainedPass((*passes, *_backend_chain(), *(p for p in user if not _takes_is_inference(p))))
    init_backend_registration()  # registering a device's backend later would reset its entry
    saved = dict(backend_graph_passes)
    try:
        for device in _DEVICES:
            previous = saved.get(device)
            if isinstance(previous, _AfterFakeUpdate):  # an outer block's: its chain is in ours already
                previous = previous.then
            backend_graph_passes[device] = _AfterFakeUpdate(chain, previous)
        with inductor_config.patch(post_grad_custom_post_pass=ChainedPass(stays) if stays else None):
            yield
    finally:
        backend_graph_passes.clear()
        backend_graph_passes.update(saved)


def pass_of(model: nn.Module) -> FsdpPass | None:
    """The pass `attach_pass()` attached to `model` (None if passes are off or `model` is not a wrapped root)."""
    return getattr(model, _PASS_ATTR, None)


@contextlib.contextmanager
def compile_scope(model: nn.Module) -> Iterator[FsdpPass | None]:
    """Inside the block, compiles run `model`'s pass (chained with any pass already configured), and
    the DTensors of its meshes get per-rank compile-cache keys ([Note: per-rank AOTAutograd cache
    keys for DTensor inputs] in `_compat.py`); both end with the block.

    Needed only when the model is compiled as part of a larger function; `torch.compile(model)`
    applies it by itself. With the model's passes off, only the cache keys.

        step = torch.compile(train_step)          # calls the wrapped model inside
        with simplefsdp.compile_scope(model):
            loss = step(batch)
    """
    graph_pass = pass_of(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(rank_aware_cache_keys(getattr(model, _MESHES_ATTR, ())))
        if has_regions(model):  # simplefsdp/regions.py; [Note: the passes skip region bodies]
            stack.enter_context(region_compiles())
            # [Note: a region must not save the gathered weights] in region_inputs.py
            joint = ChainedPass([*configured_passes(inductor_config.joint_custom_pre_pass), ForwardRegionInputs()])
            stack.enter_context(inductor_config.patch(joint_custom_pre_pass=joint))
        if has_checkpointed_blocks(model):  # [Note: side effects in a checkpointed block run once when compiled]
            stack.enter_context(checkpoint_side_effects_once())
        if graph_pass is None:
            yield None
            return
        if not any(p is graph_pass for p in installed()):  # else a nested call of the same model
            stack.enter_context(running((graph_pass,)))
        if graph_pass.config.reorder is not None:
            # Inductor's peak-memory reordering sinks each all-gather back to its wait (visible in the
            # generated code on torch 2.13), undoing the prefetch; the pass bounds its extra memory itself.
            stack.enter_context(inductor_config.patch(reorder_for_peak_memory=False))
        if _on_the_cpu(model):  # [Note: no buffer reuse on the CPU]
            stack.enter_context(inductor_config.patch(allow_buffer_reuse=False))
        stack.enter_context(functorch_config.patch(force_non_lazy_backward_lowering=True))
        yield graph_pass


def _on_the_cpu(model: nn.Module) -> bool:
    """Whether `model`'s parameters (and so its collectives' buffers) live on the CPU.

    [Note: no buffer reuse on the CPU]
    Inductor's generated code does not always free a buffer at its last use: when a later buffer has
    the same size, it keeps the first for it, if its own estimate of the graph's peak says holding it
    until then costs nothing. That estimate counts the graph's buffers only. gloo's staging copy of
    a collective's buffer (a reduce-scatter copies its whole input bucket before reducing it, see
    `DeviceProfile.staging` in `passes/cost.py`) is outside it, and that copy is often the step's
    peak: at the launch of the backward's first reduction, gradient buffers kept for later blocks'
    gradients of the same sizes raise the peak above what the liveness walk predicts (it frees every
    buffer at its last use); with reuse off the two agree (bench/results/measurements.md, "buffer reuse"). So a
    wrapped model on the CPU compiles with `allow_buffer_reuse=False`, and glibc serves the
    allocations instead (freed memory kept for the next, `simplefsdp/cpu_memory.py`). On a GPU,
    where NCCL stages nothing in PyTorch's allocator, reuse stays on (not measured there with NCCL
    between ranks)."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


# [Note: nothing traceable in the eager wrapper]
# While the wrapper runs eagerly, Dynamo's frame callback is still set: every Python frame it calls
# (a contextlib helper, our own functions) would be compiled -- and with fullgraph=True fail. So it
# calls only `torch.compiler.is_compiling()` and the two fully disabled functions below.
@torch.compiler.disable
def _enter(model: nn.Module) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    refresh_keys(model)  # [Note: what decides that two blocks share one region] in simplefsdp/regions.py
    stack.enter_context(compile_scope(model))
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
        configured = any(isinstance(p, FsdpPass) and p.uuid() == pass_key for p in installed())
        if not configured and not warned:
            warned = True
            warnings.warn(
                f"simplefsdp: a wrapped {cls.__name__} is being compiled inside a larger compiled function, "
                "where simplefsdp's graph passes (bucketing, reordering) and per-rank compile-cache keys do "
                "not apply by themselves; the graphs will be correct but unbucketed. Call the compiled function inside "
                "`with simplefsdp.compile_scope(model):`, or compile the model itself.",
                UserWarning,
                stacklevel=2,
            )
        return configured

    return check


@functools.cache
def _compiling_class(cls: type[nn.Module], pass_key: str | None) -> type[nn.Module]:
    """`cls` with a `forward` that runs inside `compile_scope(model)`: under the pass keyed `pass_key` (its
    `uuid()`), named `PassOnCompile[<cls>]`, or, with passes off (None), under the compile-cache
    scope alone, named `CompileScope[<cls>]`, so a traceback or `repr` says what was added."""
    original_forward = cls.forward

    def compiled_entry(self, *args, **kwargs):
        return original_forward(self, *args, **kwargs)

    entry = _fresh_code(compiled_entry)
    check_configured = None if pass_key is None else _inactive_check(cls, pass_key)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # inlined into a larger compiled function, see the module note
            if check_configured is not None:
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
    adds = "CompileScope" if pass_key is None else "PassOnCompile"
    return subclass(cls, adds=adds, attrs={"forward": eager_top_frame(forward), "__module__": cls.__module__})


def attach_pass(model: nn.Module, graph_pass: FsdpPass | None, *, cache_key_meshes: Iterable[object] = ()) -> None:
    """Attach `graph_pass` to the wrapped root `model` so its compiles run it (None: passes off), and
    give the DTensors on `cache_key_meshes` rank-aware compile-cache keys while it compiles."""
    setattr(model, _PASS_ATTR, graph_pass)
    setattr(model, _MESHES_ATTR, tuple(cache_key_meshes))
    model.__class__ = _compiling_class(type(model), None if graph_pass is None else graph_pass.uuid())
