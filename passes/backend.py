"""How a bucket's reduce-scatter is issued on the backend that runs it.

[Note: gloo's reduce-scatter is an all-reduce of a copy]
torch's gloo backend has no reduce-scatter of its own for a flat tensor: it clones the input,
all-reduces the clone, and copies this rank's chunk out (read off its allocations on torch 2.13:
`reduce_scatter_tensor` of an n-element input allocates n more elements inside
`c10d::reduce_scatter_tensor_coalesced_` besides its n / world output; a calibrated profile's
`staging["reduce_scatter"]` is about 1.0, `staging["all_reduce"]` 0). The bucket's input is a buffer
the pass made for this one collective (`reduce_scatter_copy_in`) and nothing reads after it, so on
gloo the pass all-reduces that buffer in place (`all_reduce_`) and copies this rank's slot out
(`rank_slot`, which finds the rank when it runs: [Note: no rank in the graph] in `bucket.py`):
the same communication without the clone: the clone's world x N bytes are gone from the launch,
where the backward's peak sits, and large buckets reduce faster (bench/results/measurements.md, "gloo reduce-scatter").
Results are bitwise those of the reduce-scatter; the training tests compare the pass's results with
the unbucketed graph's on gloo.

Other backends keep the reduce-scatter (NCCL's moves half the bytes of an all-reduce). A dry run
has no real backend (its process group is the fake one): it issues what the device profile it
predicts for was measured on (`DeviceProfile.backend`), set for the trace by `simulating`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch.distributed as dist

from simplefsdp._compat import resolve_process_group
from simplefsdp.gloo import is_gloo

__all__ = ["cache_tag", "reduces_in_place", "simulating"]

_SIMULATED: contextvars.ContextVar[str] = contextvars.ContextVar("simplefsdp_simulated_backend", default="")


@contextlib.contextmanager
def simulating(backend: str) -> Iterator[None]:
    """Within the block, graphs on the fake process group are bucketed as for `backend` ("" for none)."""
    token = _SIMULATED.set(backend)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


def reduces_in_place(group_name: str) -> bool:
    """Whether a reduce-scatter bucket on process group `group_name` is issued as an in-place all-reduce
    of its copy-in buffer ([Note: gloo's reduce-scatter is an all-reduce of a copy])."""
    return is_gloo(_issuing(str(dist.get_backend(resolve_process_group(group_name)))))


def _issuing(backend: str) -> str:
    """The backend whose collectives a graph on `backend` is bucketed for: the simulated one on the fake group."""
    return _SIMULATED.get() if backend == "fake" else backend


def cache_tag() -> str:
    """What of the backends decides the pass's output in this process, for the compile cache key
    (`FsdpPass.uuid`): how the default group's reduce-scatter buckets are issued ("" outside a
    group). The fake group simulating gloo tags as gloo does, so a job precompiled on the fake group
    (`simplefsdp precompile`) keys its graphs as the job's ranks do."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return "in-place all-reduce" if is_gloo(_issuing(str(dist.get_backend()))) else "reduce-scatter"
