"""The post-grad pass that buckets FSDP collectives: detect -> plan -> apply, as an inductor `CustomGraphPass`.

Installation is explicit for now: put `FsdpBucketingPass(...)` in
`torch._inductor.config.patch(post_grad_custom_post_pass=...)` around the compile (and lower the
backward eagerly with `torch._functorch.config.patch(force_non_lazy_backward_lowering=True)` so the
backward is compiled inside the patch too). Running it from a plain `torch.compile(model)` is the
open part of the passes issue.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

from torch import fx

from simplefsdp._compat import CustomGraphPass
from simplefsdp.passes.bucket import apply_all_gather_buckets, apply_reduction_buckets
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.plan import Candidate, check_plan, plan_by_cap

__all__ = ["BucketConfig", "FsdpBucketingPass"]

logger = logging.getLogger(__name__)

_VERSION = "1"  # bump when the pass's output changes for the same input graph (keys the compile cache)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """Size-capped bucketing of consecutive same-group, same-dtype collectives."""

    cap_bytes: int = 64 * 2**20
    bucket_all_gathers: bool = True
    bucket_reductions: bool = True


class FsdpBucketingPass(CustomGraphPass):
    """Merges FSDP all-gathers and gradient reductions per `BucketConfig`; a no-op on graphs without them."""

    def __init__(self, config: BucketConfig | None = None) -> None:
        self.config = config or BucketConfig()
        self.merged = 0  # collectives merged away so far, over every graph this instance ran on

    def __call__(self, graph: fx.Graph) -> None:
        removed = 0
        if self.config.bucket_all_gathers:
            gathers = find_fsdp_all_gathers(graph)
            cands = [
                Candidate(i, ("all_gather", g.group_name, g.group_size, g.dtype), g.shard_numel * g.dtype.itemsize)
                for i, g in enumerate(gathers)
            ]
            buckets = plan_by_cap(cands, cap_bytes=self.config.cap_bytes)
            check_plan(cands, buckets)
            removed += apply_all_gather_buckets(graph, gathers, buckets)
        if self.config.bucket_reductions:
            reductions = find_fsdp_reductions(graph)
            cands = [
                Candidate(i, (r.kind, r.reduce_op, r.group_name, r.group_size, r.dtype), _nbytes(r))
                for i, r in enumerate(reductions)
            ]
            buckets = plan_by_cap(cands, cap_bytes=self.config.cap_bytes)
            check_plan(cands, buckets)
            removed += apply_reduction_buckets(graph, reductions, buckets)
        self.merged += removed
        if removed:
            graph.lint()
            logger.info("simplefsdp bucketing: merged away %d collectives", removed)

    def uuid(self) -> str:
        return hashlib.sha256(f"simplefsdp-bucketing-{_VERSION}-{self.config}".encode()).hexdigest()


def _nbytes(reduction) -> int:
    val = reduction.collective.args[0].meta["val"]
    return val.numel() * val.dtype.itemsize
