"""Every private torch API simplefsdp touches, imported in this one file.

A torch upgrade that moves one of these breaks this file and nothing else. Each import names the
torch versions it was checked against. Only 2.13 (the CPU machines) has been available so far; the GPU
machines carry 2.11, where none of these has been run yet.
"""

from __future__ import annotations

# Compiler configuration and the post-grad pass hook: inductor's and functorch's config modules
# (scoped `.patch(...)` only, never assigned globally) and the `CustomGraphPass` base class whose
# `uuid()` keys the FX graph cache. Checked on 2.13.
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

# aot_autograd backend factory and inductor's partitioner, used to capture the forward/backward
# graphs torch.compile produces (graph inspection and graph-structure tests).
# torch._dynamo.backends.common.aot_autograd: checked on 2.13.
from torch._dynamo.backends.common import aot_autograd

# Register a named torch.compile backend ("simplefsdp_aot_eager"). torch._dynamo.register_backend:
# checked on 2.13.
from torch._dynamo.backends.registry import register_backend

# Wrap a function so that Dynamo, meeting it as the top frame, runs it eagerly and compiles what it
# calls -- the mechanism behind `torch.compiler.disable(recursive=False)` -- yet, unlike that,
# traces straight through it when it is called from a frame being compiled (no graph break). How a
# wrapped model's forward sets the compile config around its own compilation (passes/install.py).
# Unlike `skip_code`, it survives `torch.compiler.reset()`.
# torch._dynamo.external_utils.get_nonrecursive_disable_wrapper: checked on 2.13.
from torch._dynamo.external_utils import get_nonrecursive_disable_wrapper as eager_top_frame
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass

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

# OpOverload / OpOverloadPacket: the types of `torch.ops.<ns>.<op>[.overload]`, to recognise FX targets.
# torch._ops: checked on 2.13.
from torch._ops import OpOverload, OpOverloadPacket

# Fake tensors, for filling `meta["val"]` of nodes a pass adds. torch._subclasses: checked on 2.13.
from torch._subclasses.fake_tensor import FakeTensorMode

# Look up a process group by the name functional collectives carry in the graph. Checked on 2.13.
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

# Placement of a dim sharded by two mesh dims where the left one shards the right one's chunks
# (FSDP over TP on the same tensor dim), and the root mesh a submesh was sliced from.
# torch.distributed.tensor.placement_types._StridedShard, DeviceMesh._get_root_mesh: checked on 2.13.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# torch.utils._pytree: tree_map over (args, kwargs) for the mixed-precision input cast, leaves of FX args.
# Stable since 2.0; checked on 2.13.
from torch.utils._pytree import tree_leaves, tree_map_only


# [Note: per-rank AOTAutograd cache keys for DTensor inputs]
# torch 2.13 (and, per the torch issue, earlier releases) keys the AOTAutograd cache entry of a DTensor
# input by `DTensor._stable_hash_for_caching`, which hashes the DTensorSpec (mesh, placements,
# *global* shape) only (pytorch/pytorch#188390). Ranks
# that share a cache directory (every rank of a node does by default) then share entries although
# their traced graphs differ: an uneven shard has a rank-dependent local shape, and on a 2-D mesh the
# process-group names baked into the graph differ by rank. Seen here: on a warm cache one rank loaded
# another's graph and failed a size assert, another could not resolve a group name, a third hung
# in a collective. The override below appends what the spec leaves out -- this rank's local shape
# and stride, its mesh coordinate and the group names of the mesh dims -- so ranks whose graphs can
# differ get different keys, and ranks whose graphs are identical still share. It only ever makes
# keys more specific (never a wrong hit where torch had none), and it is installed by `wrap()`.
def _rank_aware_stable_hash(self) -> str:
    import hashlib

    mesh = self.device_mesh
    local = self._local_tensor
    extra = (
        tuple(local.shape),
        tuple(local.stride()),
        tuple(mesh.get_coordinate() or ()),
        tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim)),
    )
    data = (_torch_stable_hash(self) if _torch_stable_hash else _spec_summary(self)) + repr(extra)
    return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


def _spec_summary(self) -> str:
    """What torch's own hash covers, for a torch without `DTensor._stable_hash_for_caching`."""
    return repr((self.device_mesh.mesh.tolist(), self.placements, tuple(self.shape), self.dtype, self.requires_grad))


def install_rank_aware_dtensor_cache_keys() -> None:
    """Install the override of [Note: per-rank AOTAutograd cache keys for DTensor inputs]; idempotent."""
    from torch.distributed.tensor import DTensor

    global _torch_stable_hash
    current = getattr(DTensor, "_stable_hash_for_caching", None)
    if getattr(current, "_simplefsdp_rank_aware", False):
        return
    _torch_stable_hash = current
    _rank_aware_stable_hash._simplefsdp_rank_aware = True
    DTensor._stable_hash_for_caching = _rank_aware_stable_hash


def root_mesh(mesh):
    """The mesh `mesh` was sliced from (itself when it is a root). `DeviceMesh._get_root_mesh`: checked on 2.13."""
    return mesh._get_root_mesh()


def fake_store():
    """A `FakeStore` for the "fake" process-group backend: one process traces any world size.

    torch.testing._internal.distributed.fake_pg: checked on 2.13. Importing it registers
    the "fake" backend with torch.distributed, so it is imported lazily, only when asked for.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


_torch_stable_hash = None  # torch's own DTensor._stable_hash_for_caching, once replaced

__all__ = [
    "CustomGraphPass",
    "CustomInferenceAwareGraphPass",
    "FakeTensorMode",
    "OpOverload",
    "OpOverloadPacket",
    "StridedShard",
    "aot_autograd",
    "eager_top_frame",
    "fake_store",
    "functorch_config",
    "inductor_config",
    "install_rank_aware_dtensor_cache_keys",
    "min_cut_rematerialization_partition",
    "register_backend",
    "resolve_process_group",
    "root_mesh",
    "run_and_get_code",
    "stable_topological_sort",
    "tree_leaves",
    "tree_map_only",
]
