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
from typing import Literal

from torch import fx

from simplefsdp._compat import CustomGraphPass
from simplefsdp.passes.bucket import apply_all_gather_buckets, apply_reduction_buckets
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.plan import Bucket, Candidate, check_plan, plan_by_blocks, plan_by_cap, plan_by_patterns

__all__ = ["BucketConfig", "FsdpBucketingPass"]

logger = logging.getLogger(__name__)

_VERSION = "1"  # bump when the pass's output changes for the same input graph (keys the compile cache)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """Which plan (see `plan.py`) decides the buckets.

    - `"blocks"` (default): one bucket per repeated block in `blocks` (e.g. from
      `find_repeated_blocks(model)`), one for the other parameters;
    - `"patterns"`: one bucket per module-FQN pattern in `patterns`;
    - `"cap"`: graph order, at most `cap_bytes` per bucket.
    Collectives on different process groups or in different dtypes never share a bucket.
    """

    plan: Literal["blocks", "patterns", "cap"] = "blocks"
    blocks: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    cap_bytes: int = 64 * 2**20
    bucket_all_gathers: bool = True
    bucket_reductions: bool = True

    def __post_init__(self) -> None:
        if self.plan not in ("blocks", "patterns", "cap"):
            raise ValueError(f"unknown bucket plan {self.plan!r}; expected 'blocks', 'patterns' or 'cap'")
        if self.plan == "patterns" and not self.patterns:
            raise ValueError("the 'patterns' bucket plan needs patterns=(...), e.g. ('tok_embeddings', 'layers.*')")

    def make_plan(self, candidates: list[Candidate]) -> list[Bucket]:
        if self.plan == "blocks":
            buckets = plan_by_blocks(candidates, blocks=self.blocks)
        elif self.plan == "patterns":
            buckets = plan_by_patterns(candidates, patterns=self.patterns)
        else:
            buckets = plan_by_cap(candidates, cap_bytes=self.cap_bytes)
        check_plan(candidates, buckets)
        return buckets


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
                Candidate(i, ("all_gather", g.group_name, g.group_size, g.dtype), g.nbytes, g.owner)
                for i, g in enumerate(gathers)
            ]
            removed += apply_all_gather_buckets(graph, gathers, self.config.make_plan(cands))
        if self.config.bucket_reductions:
            reductions = find_fsdp_reductions(graph)
            cands = [
                Candidate(i, (r.kind, r.reduce_op, r.group_name, r.group_size, r.dtype), r.nbytes, r.owner)
                for i, r in enumerate(reductions)
            ]
            removed += apply_reduction_buckets(graph, reductions, self.config.make_plan(cands))
        self.merged += removed
        if removed:
            graph.lint()
            logger.info("simplefsdp bucketing: merged away %d collectives", removed)

    def uuid(self) -> str:
        return hashlib.sha256(f"simplefsdp-bucketing-{_VERSION}-{self.config}".encode()).hexdigest()
