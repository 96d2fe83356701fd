"""Every private torch API simplefsdp touches, reached through this one file.

A torch upgrade that moves one of these breaks this file and nothing else. Each entry names the
torch versions it was checked on: 2.13, which CI runs, so every entry runs in the test suite there;
2.11, read against its source ([Note: torch 2.11 review]) and run with the whole CPU suite on
torch 2.11.0+cu130 (bench/results/compat_runs.md), which found what [Note: torch 2.11 folds
is_exporting] works around.

[Note: torch 2.11 review]
Every entry below read against the torch 2.11.0 wheel's Python source (2.11.0+cu130, downloaded and
unpacked). "checked": the name exists there with the signature / fields we use. "fallback": what
runs on 2.11 instead.
- functorch_config (`enable_autograd_cache`, `force_non_lazy_backward_lowering`), inductor_config
  (`post_grad_custom_post_pass`, `reorder_for_peak_memory`, `fx_graph_cache`): checked.
- CustomGraphPass: checked. CustomInferenceAwareGraphPass: absent in 2.11 -- fallback: None (the
  `is_inference` flag is not forwarded to a user's pass; there is no such pass interface to honour).
- get_nonrecursive_disable_wrapper (eager_top_frame): present, but run it raises when traced from
  a larger compiled function -- fallback: [Note: torch 2.11 folds is_exporting].
- aot_autograd, register_backend,
  min_cut_rematerialization_partition, stable_topological_sort, run_and_get_code, set_logs,
  OpOverload / OpOverloadPacket, FakeTensorMode, tree_leaves / tree_map_only, flop_registry: checked.
- _resolve_process_group: checked (2.11 re-exports it from `torch._C._distributed_c10d`).
- _StridedShard: checked (now a subclass of a C++ `StridedShard`; the constructor was not compared).
- c10d_functional: the schemas are C++ (not in the wheel's Python); the Python meta kernels match
  all_gather_into_tensor(input, group_size, group_name), all_gather_into_tensor_out(input,
  group_size, group_name, *, out), reduce_scatter_tensor(input, reduce_op, group_size, group_name);
  all_reduce / wait_tensor only by name. Partly checked.
- foreach_copy_, chunk_cat: checked (`torch._foreach_copy_`, `torch._chunk_cat` in the stubs).
- all_gather_single / reduce_scatter_single: absent in 2.11 -- fallback: all_gather_into_tensor /
  reduce_scatter_tensor (present, same arguments).
- version_counter (`Tensor._version`): checked (`TensorBase._version: int` in 2.11's stubs).
- root_mesh (`DeviceMesh._get_root_mesh`), unwrap_compiled (`_orig_mod`): checked.
- module_fqn (the `nn_module_stack` format): not verified (built by Dynamo at trace time; reading
  would not settle it).
- DCP_METADATA_GLOBALS: every class / function named exists in 2.11's `checkpoint.metadata`,
  `checkpoint.filesystem._StorageInfo`, `serialization._get_layout`: checked (that 2.11's writer
  pickles no other name was not checked).
- init_fake_process_group: 2.11 < 2.13, so the fallback runs: `FakeStore` from
  `torch.testing._internal.distributed.fake_pg` (present, checked).
- rank_aware_cache_keys: 2.11's DTensor has no `_stable_hash_for_caching` and no file of the
  2.11 wheel names it -- fallback: the scope does nothing (there is no method to replace), so the
  per-rank key does nothing on 2.11. Whether 2.11's cache can serve one rank another's graph is not known.
- allocator_events, count_cpu_allocations_on_every_thread: added after this review (used by the
  benchmarks' tensor-peak measurement, `calibrate.high_water.tensor_high_water_bytes`); not read
  against 2.11.
- Not a _compat entry, but the issue asked: `redistribute(backward_dtype=...)` exists in 2.11 and
  its backward casts the gradient to `backward_dtype` before redistributing (the reduction), so by
  reading, `reduce_dtype` applies on 2.11. Not run.

ATen operators whose names start with an underscore (`aten._to_copy`, `aten._scaled_dot_product_*`)
are not listed: they are operators of the traced graphs, not Python internals. Python-level private
functions (`torch._foreach_copy_`, `torch._chunk_cat`) are.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

# Compiler configuration and the post-grad pass hook: inductor's and functorch's config modules
# (scoped `.patch(...)` only, never assigned globally) and the `CustomGraphPass` base class whose
# `uuid()` keys the FX graph cache. Checked on 2.13.
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.distributed as dist

# aot_autograd backend factory and inductor's partitioner: the debugging backend
# "simplefsdp_aot_eager" partitions as inductor does. torch._dynamo.backends.common.aot_autograd,
# torch._functorch.partitioners.min_cut_rematerialization_partition: checked on 2.13.
from torch._dynamo.backends.common import aot_autograd

# Register a named torch.compile backend ("simplefsdp_aot_eager"). torch._dynamo.register_backend:
# checked on 2.13.
from torch._dynamo.backends.registry import register_backend

# Wrap a function so that Dynamo, meeting it as the top frame, runs it eagerly and compiles what it
# calls -- the mechanism behind `torch.compiler.disable(recursive=False)` -- yet, unlike that,
# traces straight through it when it is called from a frame being compiled (no graph break). How a
# wrapped model's forward sets the compile config around its own compilation (passes/install.py).
# Unlike `skip_code`, it survives `torch.compiler.reset()`.
# torch._dynamo.external_utils.get_nonrecursive_disable_wrapper: checked on 2.13 and 2.11 (run).
from torch._dynamo.external_utils import get_nonrecursive_disable_wrapper as _nonrecursive_disable_wrapper
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass

# Inductor's per-device backend graph passes: a dict device type -> `CustomGraphModulePass` | None
# that inductor runs on each graph holding tensors of that device, after its post-grad passes and
# the fake-tensor update that follows them (passes/install.py, [Note: where the pass runs]), with
# `init_backend_registration` (registers the devices' backends, which would reset an entry).
# torch._inductor.codegen.common.custom_backend_passes / init_backend_registration and
# torch._inductor.custom_graph_pass.CustomGraphModulePass: checked on 2.13; added after the 2.11
# review -- fallback where absent: None (the pass runs in `post_grad_custom_post_pass`, before the
# update, as it used to).
# Inductor's re-run of fake-tensor propagation after its post-grad passes
# (torch._inductor.fx_utils.FakeTensorUpdater.incremental_update, returns the nodes re-run): what
# `bench/compile_time.py` counts. Checked on 2.13; added after the 2.11 review -- fallback where
# absent: None (the bench prints no count).
try:
    from torch._inductor.fx_utils import FakeTensorUpdater
except ImportError:  # pragma: no cover - older torch
    FakeTensorUpdater = None

try:
    from torch._inductor.codegen.common import custom_backend_passes as backend_graph_passes
    from torch._inductor.codegen.common import init_backend_registration
    from torch._inductor.custom_graph_pass import CustomGraphModulePass
except ImportError:  # pragma: no cover - older torch
    backend_graph_passes = init_backend_registration = None
    CustomGraphModulePass = CustomGraphPass

# The post-grad pass interface that also receives `is_inference` (a user's pass may implement it;
# our chain forwards the flag). torch._inductor.custom_graph_pass: checked on 2.13; None where absent.
try:
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass
except ImportError:  # pragma: no cover - older torch
    CustomInferenceAwareGraphPass = None

# Re-sort a graph after inserting nodes, keeping the existing order where dependencies allow.
# torch._inductor.pattern_matcher.stable_topological_sort: checked on 2.13.
from torch._inductor.pattern_matcher import stable_topological_sort

# The Python source inductor generates for a compiled call (to check what order survives lowering).
# torch._inductor.utils.run_and_get_code: checked on 2.13.
from torch._inductor.utils import run_and_get_code

# Set the level of every torch logger at once (the other ranks of `simplefsdp train` show errors
# only). torch._logging.set_logs (documented, in a private module): checked on 2.13.
from torch._logging import set_logs as set_torch_logs

# OpOverload / OpOverloadPacket: the types of `torch.ops.<ns>.<op>[.overload]`, to recognise FX targets.
# torch._ops: checked on 2.13.
from torch._ops import OpOverload, OpOverloadPacket

# Fake tensors, for filling `meta["val"]` of nodes a pass adds. torch._subclasses: checked on 2.13.
from torch._subclasses.fake_tensor import FakeTensorMode

# Look up a process group by the name functional collectives carry in the graph. Checked on 2.13.
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

# Placement of a dim sharded by two mesh dims where the left one shards the right one's chunks
# (FSDP over TP on the same tensor dim). torch.distributed.tensor.placement_types._StridedShard:
# checked on 2.13.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# A mode that sees every ATen op dispatched while it is active: the CPU measurement of live tensor
# bytes (`inspect/live_bytes.py`). torch.utils._python_dispatch.TorchDispatchMode: checked on 2.13.
from torch.utils._python_dispatch import TorchDispatchMode

# torch.utils._pytree: tree_map over (args, kwargs) for the mixed-precision input cast, leaves of FX args.
# Stable since 2.0; checked on 2.13.
from torch.utils._pytree import tree_leaves, tree_map_only

# FLOP formulas per ATen op (matmuls, convolutions, attention), keyed by OpOverloadPacket: what the
# cost model and the schedule view count compute with. torch.utils.flop_counter.flop_registry
# (undocumented): checked on 2.13.
from torch.utils.flop_counter import flop_registry

# FX code generation in the boxed calling convention: the generated function takes its inputs in
# one list and clears it, so each input can be freed at its last use (what inductor's code does).
# The `simplefsdp_aot_eager` backend's graphs use it. torch.fx.graph._BoxedCodeGen: checked on
# 2.13; added after the 2.11 review -- fallback where absent: None (inputs live until the graph returns).
BoxedCodeGen = getattr(torch.fx.graph, "_BoxedCodeGen", None)

# The functional collectives of traced graphs: `torch.ops._c10d_functional.<op>` (all_gather_into_tensor,
# all_gather_into_tensor_out, reduce_scatter_tensor, all_reduce, wait_tensor). Schemas checked on 2.13:
# all_gather_into_tensor(input, group_size, group_name), all_gather_into_tensor_out(input, group_size,
# group_name, *, out), reduce_scatter_tensor(input, reduce_op, group_size, group_name),
# all_reduce(input, reduce_op, group_name), wait_tensor(tensor).
c10d_functional = torch.ops._c10d_functional

# Multi-tensor kernels the CPU copy ops run (the same ones FSDP2's eager copies use): `_foreach_copy_`
# copies (and casts) a list of tensors into a list of views in one call; `_chunk_cat` pads each tensor's
# dim 0 to a multiple of `num_chunks` and interleaves the chunks. torch._foreach_copy_, torch._chunk_cat:
# checked on 2.13.
foreach_copy_ = torch._foreach_copy_
chunk_cat = torch._chunk_cat


# Eager single-tensor collectives: torch 2.13 names them `all_gather_single` / `reduce_scatter_single`
# and deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` (same arguments), which older
# releases have alone. Checked on 2.13.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def gloo_with_one_worker(store, rank: int, size: int, timeout):
    """A gloo backend whose collectives run on one worker thread (`simplefsdp/gloo.py` says why).

    `init_process_group("gloo")` always builds a two-thread gloo backend; the worker-thread count is
    only reachable through the backend's private options: `ProcessGroupGloo._Options` (`_devices`,
    `_threads`, `_timeout`) and the `ProcessGroupGloo(store, rank, size, options)` constructor.
    Checked on 2.13; added after the 2.11 review."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def gloo_worker_threads(group) -> int | None:
    """How many worker threads `group`'s CPU gloo backend runs collectives on (None: no gloo
    backend there). `ProcessGroup._get_backend` and the options' `_threads`: checked on 2.13."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend in this group (e.g. NCCL alone)
        return None
    if not isinstance(backend, dist.ProcessGroupGloo):
        return None
    return int(backend.options._threads)


def compile_front_half(gm: torch.fx.GraphModule, example_inputs, *, inner_compile):
    """Inductor's compile of `gm` up to, not including, code generation: inductor's decompositions,
    joint-graph passes and partitioner run, then `inner_compile(graph_module, example_inputs,
    is_inference=..., ...)` gets each partitioned graph and returns what runs in its place (a boxed
    callable). With `run_post_grad_passes` inside it, this is the dry run's capture
    (`inspect/capture.py`). torch._inductor.compile_fx.compile_fx (its `inner_compile` argument,
    called with `is_inference=`): checked on 2.13; read in 2.11's source, same signature."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def run_post_grad_passes(gm: torch.fx.GraphModule, example_inputs, *, is_inference: bool) -> None:
    """Inductor's post-grad passes on `gm`, in place (the installed custom passes, ours among them,
    run inside), as inductor's own inner compile runs them: under the fake mode of the graph's
    inputs, set where the passes look it up. torch._inductor.compile_fx._recursive_post_grad_passes,
    torch._inductor.virtualized.V.set_fake_mode, torch._guards.detect_fake_mode: checked on 2.13;
    read in 2.11's source, present with the same signatures."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        _recursive_post_grad_passes(gm, is_inference=is_inference)


def allocator_events(prof) -> list[tuple[int, int, int]]:
    """(start in ns, signed bytes, tensor bytes allocated after it) of every allocator event a
    finished `torch.profiler.profile(..., profile_memory=True)` recorded, sorted by time.
    `prof.events()` folds these into the ops they happened in (net bytes per op), which loses the
    peak inside an op; the event tree keeps each allocation and free.
    `profiler.kineto_results.experimental_event_tree()`, `_EventType.Allocation`, node `.tag`,
    `.children`, `.start_time_ns`, `.extra_fields.alloc_size` / `.total_allocated`: checked on 2.13."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            found.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(found)


@functools.cache
def _cpu_usage_flag() -> ctypes.c_bool:
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage")


@contextlib.contextmanager
def count_cpu_allocations_on_every_thread() -> Iterator[None]:
    """Inside the block, c10's CPU allocator keeps its running total of allocated bytes on every
    thread (the `caffe2_report_cpu_memory_usage` flag of libc10), not only on threads the profiler
    follows, so the totals `allocator_events` reads count a tensor freed on another thread (gloo
    frees a reduction's staging copy on its worker thread). On exit the flag is as it was (blocks
    nest). Costs a lock per CPU allocation while on.

    A block allocated inside and freed outside stays in the allocator's size table; a block allocated
    outside and freed inside is not subtracted. So a series of measurements whose totals are compared
    -- tensors living from one measured call into the next -- runs inside one block (the benchmarks'
    memory rows do). Linux (libc10.so); the flag and its effect: checked on 2.13."""
    flag = _cpu_usage_flag()
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


def counting_cpu_allocations_on_every_thread() -> bool:
    """Whether `count_cpu_allocations_on_every_thread` is on now (the libc10 flag's value)."""
    return bool(_cpu_usage_flag().value)


# `nn.RNNBase`'s bookkeeping of its weights (`torch/nn/modules/rnn.py`): `_flat_weights_names` (the
# weights' attribute names in the fused kernel's order), the `_flat_weights` list its forward and
# input checks read, `_flat_weight_refs` (weak references it compares to decide whether to rebuild
# that list) and the two methods that rebuild it, `_update_flat_weights` and `_init_flat_weights`
# (`_apply`, so `.to()` / `to_empty()`, calls the latter). Checked on 2.13; added after the 2.11 review.
RNN_FLAT_WEIGHTS = "_flat_weights"
RNN_REBUILD_METHODS = ("_update_flat_weights", "_init_flat_weights")


def rnn_weight_names(module: torch.nn.RNNBase) -> list[str]:
    """The attribute names of `module`'s weights, in the order its fused kernel takes them."""
    return module._flat_weights_names


def point_rnn_weights(module: torch.nn.RNNBase, weights: list[torch.Tensor | None]) -> None:
    """Make `module`'s own weight list (and the references it compares) hold `weights`."""
    module.__dict__[RNN_FLAT_WEIGHTS] = weights
    module.__dict__["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in weights]


# A warning torch logs at every trace of a selectively checkpointed region (`context_fn`) under
# torch.compile, asking the user to make sure the region has no in-place ops: the logger that
# emits it and a phrase of its text (`torch/_higher_order_ops/wrap.py`). Checked on 2.13; added
# after the 2.11 review.
CHECKPOINT_CONTEXT_FN_WARNING = (
    "torch._higher_order_ops.wrap",
    "context_fn is passed to torch.utils.checkpoint under torch.compile",
)


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes `tensor` has seen (its autograd version counter): a `.zero_()` or an
    optimizer's `zero_grad(set_to_none=False)` bumps it. `Tensor._version`: checked on 2.13."""
    return tensor._version


def root_mesh(mesh):
    """The mesh `mesh` was sliced from (itself when it is a root). `DeviceMesh._get_root_mesh`: checked on 2.13."""
    return mesh._get_root_mesh()


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether `module.compile()` (in place) was called on `module`. `nn.Module._compiled_call_impl`:
    checked on 2.13 (set by `compile()`, None before)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module itself for what `torch.compile(module)` returned (an `OptimizedModule`, whose state-dict
    keys would carry an `_orig_mod.` prefix), else `module`. `OptimizedModule._orig_mod`: checked on 2.13."""
    return getattr(module, "_orig_mod", module)


_STACK_PART = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def module_fqn(node: torch.fx.Node) -> str:
    """FQN of the innermost module `node` was traced in ("" at the root or if unknown).

    Read from Dynamo's `nn_module_stack` (`fwd_nn_module_stack` in a backward graph): an ordered dict
    whose values are `(path, type)` with paths such as `L['self'].layers[0].attention` or
    `L['self']._modules['x']`. Format checked on 2.13."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    path = path.removeprefix("L['self']").replace("._modules", "")
    return _STACK_PART.sub(r".\1", path).strip(".")


# What a DCP `.metadata` pickle may name besides torch dtypes (see checkpoint/safe_reader.py): DCP's
# metadata dataclasses, the filesystem writer's per-item storage record, the layout decoder and plain
# containers. Checked on 2.13 (the names DCP's FileSystemWriter pickles there).
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to the torch.layout
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


def _not_exporting_module() -> types.ModuleType:
    """A module (registered, so Dynamo's guards can find it by name) whose `torch.compiler.is_exporting`
    is `torch.onnx.is_in_onnx_export`, which Dynamo folds to False and which is False at run time
    outside an ONNX export: the globals of 2.11's wrapper ([Note: torch 2.11 folds is_exporting])."""
    name = f"{__name__}._eager_top_frame_globals"
    if name not in sys.modules:
        compiler = types.ModuleType(f"{name}.torch.compiler")
        compiler.is_exporting = torch.onnx.is_in_onnx_export
        # its first call imports a module of torch.onnx: done here, never while Dynamo's frame
        # callback is set (under `fullgraph=True` it refused to trace that import's generators)
        torch.onnx.is_in_onnx_export()
        shim = types.ModuleType(f"{name}.torch")
        shim.compiler = compiler
        module = types.ModuleType(name)
        module.torch = shim
        module.__builtins__ = __builtins__  # the wrapper raises a RuntimeError under torch.export
        sys.modules[name] = module
    return sys.modules[name]


def eager_top_frame(fn: Callable) -> Callable:
    """[Note: torch 2.11 folds is_exporting]
    The wrapper's code raises when `torch.compiler.is_exporting()` (torch.export refuses it). Dynamo
    2.11 folds that call to True under *every* compile, so a wrapped model called from a larger
    compiled function made Dynamo raise inside the wrapper: `fullgraph=True` failed, and without it
    Dynamo gave up on the whole larger function and ran it eagerly (seen on torch 2.11.0; 2.13 reads
    the real export flag). Below 2.13 the wrapper is rebuilt from the same code object (Dynamo
    recognises the top frame by that object) and closure, its globals those of a module whose
    `torch.compiler.is_exporting` Dynamo folds to False."""
    wrapper = _nonrecursive_disable_wrapper(fn)
    if major_minor(torch.__version__) >= (2, 13):
        return wrapper
    module = _not_exporting_module()
    rebuilt = types.FunctionType(wrapper.__code__, vars(module), wrapper.__name__, None, wrapper.__closure__)
    return functools.update_wrapper(rebuilt, fn)


# Inductor's cache directory: `cache_dir()` (TORCHINDUCTOR_CACHE_DIR, else torch's default under the
# temp directory; it creates the folder) and `temporary_cache_dir(path)` (sets the variable for a
# block and clears inductor's in-memory caches on entry and exit, so nothing compiled against another
# directory is served from memory). torch._inductor.runtime.cache_dir_utils: checked on 2.13.
# The compile counters Dynamo, AOTAutograd and inductor keep per process (`counters[stage][name]`,
# e.g. inductor "fxgraph_cache_hit", aot_autograd "autograd_cache_miss", stats "unique_graphs").
# torch._dynamo.utils.counters: checked on 2.13. The seconds Dynamo's frame compiles took, the
# compile backend's (AOTAutograd + inductor) included: `calculate_time_spent()` ->
# {"entire_frame_compile": s, "backend_compile": s, ...} since the process started. Checked on 2.13.
def inductor_cache_dir() -> str:
    """Torch's inductor cache directory as this process sees it now (created if missing)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def using_inductor_cache_dir(path: str) -> contextlib.AbstractContextManager:
    """Within the block, inductor (and the Triton kernels it compiles) caches under `path`."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(path)


def compile_counters() -> dict:
    """The process's compile counters: `[stage][name] -> int` (absent names read 0)."""
    from torch._dynamo.utils import counters

    return counters


def compile_seconds() -> tuple[float, float]:
    """(seconds in Dynamo's frame compiles, of which in the compile backend) since the process started."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return spent.get("entire_frame_compile", 0.0), spent.get("backend_compile", 0.0)


def major_minor(version: str) -> tuple[int, int]:
    """(2, 13) for "2.13.0+cpu", "2.13.0a0+git1234" or "2.13.0.dev20260101"."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def init_fake_process_group(*, rank: int, world_size: int) -> None:
    """Join torch's "fake" process group as `rank` of `world_size`: collectives trace but move no data,
    so one process can trace any world size.

    From torch 2.13, `init_process_group("fake")` without a store makes its own (checked on 2.13).
    Older releases need a store: the fallback takes the `FakeStore` from
    `torch.testing._internal.distributed.fake_pg`, the only place torch defines one (importing it
    also registers the backend); there is no public alternative there."""
    if major_minor(torch.__version__) >= (2, 13):
        dist.init_process_group("fake", rank=rank, world_size=world_size)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # pragma: no cover - torch < 2.13

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)  # pragma: no cover


# [Note: per-rank AOTAutograd cache keys for DTensor inputs]
# torch 2.13 (and, per the torch issue, earlier releases) keys the AOTAutograd cache entry of a
# DTensor input by `DTensor._stable_hash_for_caching`, which hashes the DTensorSpec (mesh,
# placements, *global* shape) only (pytorch/pytorch#188390). Ranks that share a cache directory
# (every rank of a node does by default) then share entries although their traced graphs can differ.
# Observed on 2.13 with gloo: on a warm cache one rank loaded another's graph and failed a size
# assert, another could not resolve a group name, a third hung in a collective.
# The fix appends what the spec leaves out (`rank_aware_cache_key`, the one place that says what
# goes into the key): this rank's local shape and stride and the group names of the mesh dims
# always, and its mesh coordinate where the traced graph can depend on it. Which graphs that is:
# - shared by every rank: a DTensor evenly sharded on a 1-D mesh (each `Shard(d)` dim's global size
#   a multiple of the mesh size; `Replicate` trivially). Its local shape is the same on every rank,
#   DTensor's gather and reduce-scatter of it name the one group and no offset, and the pass adds
#   no rank ([Note: no rank in the graph] in `passes/bucket.py`); an offloaded shard's host copies
#   copy the same shapes. The key is then the same on every rank: one entry, one compiled artifact.
# - per rank: an uneven shard (a rank's local shape, and with it the pad before its gather, the
#   uneven gradient's fold in `passes/uneven.py` and any global offset DTensor computes, depend on
#   the rank; ranks with equal local shapes would do, the coordinate keeps it simple and sure), and
#   any DTensor on a mesh of two or more dims -- HYBRID's `(replicate, shard)` mesh, whose group
#   names in the graph differ by rank, and tensor parallelism's combined `(dp, tp)` mesh, where TP's
#   own ops can bake this rank's coordinate into the graph (a row-sharded embedding's mask offset).
# It only ever makes keys more specific than torch's (never a wrong hit where torch had none).
# Where it applies: only inside `rank_aware_cache_keys(meshes)`, which a wrapped model enters while
# it compiles (`passes/install.py`: its forward, or `compile_scope(model)` around a larger compiled
# function), and only to DTensors on those meshes, hashed on the thread (context) that entered it.
# A wrapped model traced inside a larger compiled function outside `compile_scope(model)` gets torch's
# keys, as it gets no pass there.
# torch calls the method on the fake copies of the graph's inputs that Dynamo makes (not on the
# parameters themselves, whose mesh object the copies keep), so it cannot be set per parameter: it
# has to be the class attribute. The scope replaces it on entry of the outermost scope and puts
# torch's own function back when the last one ends; outside, `DTensor._stable_hash_for_caching` is
# torch's, and every DTensor -- on a mesh a wrapped model uses or not -- gets torch's key. A torch
# without the method (2.11, see the review) is left alone: nothing there would call it.
_RANK_AWARE_MESHES: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "simplefsdp_rank_aware_meshes", default=frozenset()
)
_rank_aware_lock = threading.Lock()
_rank_aware_depth = 0  # scopes open, over all threads
_torch_stable_hash: Callable[..., str] | None = None  # torch's own method while a scope replaces it


def rank_aware_cache_key(dtensor, own: str) -> str:
    """The AOTAutograd cache key of `dtensor` in a wrapped model's compile: torch's own key `own`
    with what makes this rank's graph differ from another's (see the Note): the same on every rank
    for an even shard on a 1-D mesh, this rank's own otherwise."""
    import hashlib

    mesh, local = dtensor.device_mesh, dtensor._local_tensor
    coordinate = tuple(mesh.get_coordinate() or ()) if _graph_depends_on_rank(dtensor) else ()
    extra = (
        tuple(local.shape),
        tuple(local.stride()),
        coordinate,
        tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim)),
    )
    return hashlib.blake2b((own + repr(extra)).encode(), digest_size=16).hexdigest()


def _graph_depends_on_rank(dtensor) -> bool:
    """Whether a graph traced from `dtensor` can differ by rank: a mesh of two or more dims, or a
    `Shard` dim whose global size the mesh dim does not divide ([Note: per-rank AOTAutograd cache
    keys for DTensor inputs])."""
    from torch.distributed.tensor import Shard

    mesh = dtensor.device_mesh
    if mesh.ndim > 1:
        return True
    return any(
        isinstance(p, Shard) and dtensor.shape[p.dim] % mesh.size(i) != 0 for i, p in enumerate(dtensor.placements)
    )


def _scoped_stable_hash(self) -> str:
    """What `DTensor._stable_hash_for_caching` is while a scope is open: torch's key, made rank-aware
    for a DTensor on one of the meshes this context's scope named."""
    own = _torch_stable_hash(self)
    if self.device_mesh not in _RANK_AWARE_MESHES.get():
        return own
    return rank_aware_cache_key(self, own)


def _open_rank_aware_scope(dtensor_class: type) -> None:
    global _rank_aware_depth, _torch_stable_hash
    with _rank_aware_lock:
        if _rank_aware_depth == 0:
            _torch_stable_hash = dtensor_class._stable_hash_for_caching
            dtensor_class._stable_hash_for_caching = _scoped_stable_hash
        _rank_aware_depth += 1


def _close_rank_aware_scope(dtensor_class: type) -> None:
    global _rank_aware_depth, _torch_stable_hash
    with _rank_aware_lock:
        _rank_aware_depth -= 1
        if _rank_aware_depth == 0:
            dtensor_class._stable_hash_for_caching = _torch_stable_hash
            _torch_stable_hash = None


@contextlib.contextmanager
def rank_aware_cache_keys(meshes: Iterable) -> Iterator[None]:
    """Inside the block, DTensors on `meshes` that this context hashes for the AOTAutograd cache get
    `rank_aware_cache_key` ([Note: per-rank AOTAutograd cache keys for DTensor inputs]); on exit
    `DTensor._stable_hash_for_caching` is as it was. Nests (and runs on several threads at once).
    `DTensor._stable_hash_for_caching`: checked on 2.13; absent on 2.11, where this does nothing."""
    from torch.distributed.tensor import DTensor

    if not hasattr(DTensor, "_stable_hash_for_caching"):
        yield
        return
    token = _RANK_AWARE_MESHES.set(_RANK_AWARE_MESHES.get() | frozenset(meshes))
    _open_rank_aware_scope(DTensor)
    try:
        yield
    finally:
        _close_rank_aware_scope(DTensor)
        _RANK_AWARE_MESHES.reset(token)


# [Note: the Trainer and Accelerate internals simplefsdp.hf relies on]
# The Trainer mixin (`simplefsdp/hf/trainer.py`) overrides Trainer methods that are not public API and
# sets Accelerate attributes that are not either. Each is reached here. Checked (read, and the Trainer
# test run, bench/results/compat_runs.md) on transformers 5.25.0 (and 5.24.0) with accelerate 1.16.0 and
# on transformers 4.51.3 with accelerate 1.14.0: the two ends of the `hf` extra's range in pyproject.toml.
# transformers and accelerate are imported inside the functions: simplefsdp itself needs neither.
# - TRAINER_HOOKS: the Trainer's private methods the mixin overrides (its checkpoint's model and
#   optimizer state), and `save_model`'s private `_internal_call` argument, which the public
#   `save_model` override keeps; `check_trainer_internals` fails with one line where one is missing.
# - ACCELERATE_FLOOR: `Accelerator.prepare_model` returns a model carrying `_is_accelerate_prepared`
#   unchanged from accelerate 1.14.0 on; before, it wrapped the sharded model in DDP, which then
#   failed ("got mixed torch.Tensor and DTensor", seen with 1.0.1).
# - `Accelerator.scaler` (read by `backward`, `prepare_optimizer` and the Trainer's checkpoint) and
#   `Accelerator.native_amp` (with `mixed_precision == "fp16"`: `unscale_gradients`, which
#   `clip_grad_norm_` calls first): attributes Accelerate sets in its constructor (no scaler for fp16
#   on CPU) and that nothing public sets.
# - `transformers.trainer.SCHEDULER_NAME` / `TRAINING_ARGS_NAME`: the Trainer's file names, module
#   constants it does not export.
TRAINER_HOOKS: tuple[str, ...] = (
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
)
ACCELERATE_FLOOR = (1, 14)


@functools.cache
def check_trainer_internals() -> None:
    """One `RuntimeError` line when the installed transformers / accelerate lack what the mixin
    relies on ([Note: the Trainer and Accelerate internals simplefsdp.hf relies on])."""
    import inspect

    import accelerate
    import transformers

    if major_minor(accelerate.__version__) < ACCELERATE_FLOOR:
        raise RuntimeError(
            f"simplefsdp.hf needs accelerate>={'.'.join(map(str, ACCELERATE_FLOOR))} (it would wrap the sharded "
            f"model in DDP); found {accelerate.__version__}"
        )
    missing = [name for name in TRAINER_HOOKS if not callable(getattr(transformers.Trainer, name, None))]
    if "_internal_call" not in inspect.signature(transformers.Trainer.save_model).parameters:
        missing.append("save_model(_internal_call=...)")
    if missing:
        raise RuntimeError(
            f"simplefsdp.hf overrides Trainer.{', Trainer.'.join(missing)}, which transformers "
            f"{transformers.__version__} does not have (checked on 4.51.3, 5.24.0 and 5.25.0)"
        )


def mark_prepared_for_accelerate(model: torch.nn.Module) -> None:
    """Accelerate's mark of a model it prepared already: `prepare_model` then returns it as it is
    (no DDP). `_is_accelerate_prepared`: checked on accelerate 1.14.0 and 1.16.0."""
    model._is_accelerate_prepared = True


def use_grad_scaler(accelerator, scaler) -> None:
    """Make `accelerator` scale the loss with `scaler` and unscale before clipping, as it does for
    fp16 with a scaler of its own. `Accelerator.scaler` / `.native_amp`: checked on accelerate 1.14.0
    and 1.16.0; set before `prepare(optimizer)`, which hands the scaler to the optimizer wrapper."""
    accelerator.scaler = scaler
    accelerator.native_amp = True


def trainer_file_names() -> tuple[str, str]:
    """(the scheduler's, the training arguments') file names in a Trainer checkpoint.
    `transformers.trainer.SCHEDULER_NAME`, `TRAINING_ARGS_NAME`: checked on 4.51.3, 5.24.0 and 5.25.0."""
    from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

    return SCHEDULER_NAME, TRAINING_ARGS_NAME


# [Note: side effects in a checkpointed block run once when compiled] (activation_checkpoint.py):
# Dynamo's switch to trace a checkpointed region whose forward mutates Python state, running the
# mutation in the forward only. `torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`:
# checked on 2.13; where a torch lacks it, nothing is set (such regions then break the graph).
def checkpoint_side_effects_once() -> contextlib.AbstractContextManager:
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


# [Note: regions reach two torch internals]
# `nested_compile_region(reuse_hash_fn=...)` is public API (checked on 2.13); on a torch without the
# argument, regions are off (`regions_supported`). Two internals are not public: the invoke_subgraph
# operator's `gen_schema`, which torch calls on every autograd dispatch of the operator only to check
# that the subgraph mutates no input, re-tracing the subgraph each time (`simplefsdp/regions.py`,
# [Note: the schema check of an invoke_subgraph is computed once]); and inductor's recursion of its
# post-grad passes into subgraphs, which runs simplefsdp's pass on each region body as if it were a
# step's graph ([Note: the passes skip region bodies] in `passes/install.py`).
def regions_supported() -> bool:
    """Whether this torch's `nested_compile_region` takes a `reuse_hash_fn` (simplefsdp's regions need it)."""
    import inspect

    return "reuse_hash_fn" in inspect.signature(torch.compiler.nested_compile_region).parameters


def nested_compile_region(fn: Callable, *, reuse_key: Callable[..., int]) -> Callable:
    """`torch.compiler.nested_compile_region(fn)` whose calls share one traced subgraph exactly when
    `reuse_key` (traced by Dynamo with the call's arguments) returns the same integer; on a torch
    without that argument, `fn` itself."""
    if not regions_supported():
        return fn
    return torch.compiler.nested_compile_region(fn, reuse_hash_fn=reuse_key, max_reuse_entries=64)


_region_depth = 0
_torch_gen_schema: Callable[..., object] | None = None
_torch_post_grad: Callable[..., None] | None = None
_REGION_BODIES: weakref.WeakSet = weakref.WeakSet()


def is_region_body(gm: torch.fx.GraphModule | None) -> bool:
    """Whether inductor is running its post-grad passes on `gm` as the body of an invoke_subgraph
    (inside `region_compiles`): simplefsdp's own passes leave such graphs alone."""
    return gm is not None and gm in _REGION_BODIES


@contextlib.contextmanager
def region_compiles() -> Iterator[None]:
    """Inside the block: the invoke_subgraph operator's schema is generated once per (subgraph,
    operand metadata) instead of once per call; and the subgraphs inductor runs its post-grad passes
    on before their parent graph are known as region bodies (`is_region_body`). Nests; on leaving
    the outermost block torch's functions are back. `InvokeSubgraphHOP.gen_schema` and
    `torch._inductor.compile_fx._recursive_post_grad_passes` (which visits a graph's subgraphs
    before the graph): checked on 2.13."""
    global _region_depth, _torch_gen_schema, _torch_post_grad
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    from torch._inductor import compile_fx

    with _rank_aware_lock:
        if _region_depth == 0:
            _torch_gen_schema, _torch_post_grad = InvokeSubgraphHOP.gen_schema, compile_fx._recursive_post_grad_passes
            InvokeSubgraphHOP.gen_schema = _memoized_gen_schema(_torch_gen_schema)
            compile_fx._recursive_post_grad_passes = _marking_bodies(_torch_post_grad)
        _region_depth += 1
    try:
        yield
    finally:
        with _rank_aware_lock:
            _region_depth -= 1
            if _region_depth == 0:
                InvokeSubgraphHOP.gen_schema, compile_fx._recursive_post_grad_passes = (
                    _torch_gen_schema,
                    _torch_post_grad,
                )
                _torch_gen_schema = _torch_post_grad = None


def _memoized_gen_schema(own: Callable[..., object]) -> Callable[..., object]:
    from torch._higher_order_ops.invoke_subgraph import FunctionalizeCtxWrapper

    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def gen_schema(self, subgraph, identifier, *operands):
        graph = subgraph.subgraph if isinstance(subgraph, FunctionalizeCtxWrapper) else subgraph
        meta = tuple(
            (tuple(o.shape), o.stride(), o.dtype, o.device, o.requires_grad)
            if isinstance(o, torch.Tensor)
            else (type(o), o if isinstance(o, int) else id(o))
            for o in operands
        )
        try:
            entries = memo.setdefault(graph, {})
        except TypeError:  # not weak-referenceable: no memo
            return own(self, subgraph, identifier, *operands)
        if (identifier, meta) not in entries:
            entries[(identifier, meta)] = own(self, subgraph, identifier, *operands)
        return entries[(identifier, meta)]

    return gen_schema


def _marking_bodies(own: Callable[..., None]) -> Callable[..., None]:
    from torch._inductor.compile_fx import _get_subgraph_names

    def recursive_post_grad_passes(gm, is_inference: bool = False) -> None:
        for name in _get_subgraph_names(gm):
            _REGION_BODIES.add(getattr(gm, name))
        own(gm, is_inference)

    return recursive_post_grad_passes


__all__ = [
    "ACCELERATE_FLOOR",
    "CHECKPOINT_CONTEXT_FN_WARNING",
    "DCP_METADATA_GLOBALS",
    "RNN_FLAT_WEIGHTS",
    "RNN_REBUILD_METHODS",
    "TRAINER_HOOKS",
    "BoxedCodeGen",
    "CustomGraphModulePass",
    "CustomGraphPass",
    "CustomInferenceAwareGraphPass",
    "FakeTensorMode",
    "FakeTensorUpdater",
    "OpOverload",
    "OpOverloadPacket",
    "StridedShard",
    "TorchDispatchMode",
    "all_gather_single",
    "allocator_events",
    "aot_autograd",
    "backend_graph_passes",
    "c10d_functional",
    "check_trainer_internals",
    "checkpoint_side_effects_once",
    "chunk_cat",
    "compiled_in_place",
    "count_cpu_allocations_on_every_thread",
    "counting_cpu_allocations_on_every_thread",
    "eager_top_frame",
    "flop_registry",
    "foreach_copy_",
    "functorch_config",
    "gloo_with_one_worker",
    "gloo_worker_threads",
    "inductor_config",
    "init_backend_registration",
    "init_fake_process_group",
    "is_region_body",
    "major_minor",
    "mark_prepared_for_accelerate",
    "min_cut_rematerialization_partition",
    "module_fqn",
    "nested_compile_region",
    "point_rnn_weights",
    "rank_aware_cache_key",
    "rank_aware_cache_keys",
    "reduce_scatter_single",
    "region_compiles",
    "regions_supported",
    "register_backend",
    "resolve_process_group",
    "rnn_weight_names",
    "root_mesh",
    "run_and_get_code",
    "set_torch_logs",
    "stable_topological_sort",
    "trainer_file_names",
    "tree_leaves",
    "tree_map_only",
    "unwrap_compiled",
    "use_grad_scaler",
    "version_counter",
]
