"""simplefsdp's post-grad pass: detect -> plan -> bucket -> reorder, as an inductor `CustomGraphPass`.

`simplefsdp.wrap()` installs one `FsdpPass` per wrapped model for the compiles of that model
(see `install.py`); `PassConfig` is what a user picks (`wrap(model, passes=PassConfig(...))`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Collection
from typing import Literal

import torch.distributed as dist
from torch import fx

from simplefsdp._compat import CustomGraphPass
from simplefsdp.passes import cost
from simplefsdp.passes.bucket import apply_all_gather_buckets, apply_reduction_buckets
from simplefsdp.passes.collectives import Collective
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.plan import (
    Bucket,
    Candidate,
    MergeKey,
    check_plan,
    plan_by_blocks,
    plan_by_cap,
    plan_by_cost,
    plan_by_patterns,
)
from simplefsdp.passes.reorder import ReorderConfig, reorder_all_gathers, reorder_reductions

__all__ = ["BucketConfig", "FsdpPass", "PassConfig", "plan_buckets"]

logger = logging.getLogger(__name__)

_VERSION = "3"  # bump when the pass's output changes for the same input graph (keys the compile cache)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """Which plan (see `plan.py`) decides the buckets.

    - `"blocks"` (default): one bucket per repeated block in `blocks` (e.g. from
      `simplefsdp.blocks.find_repeated_blocks(model)`, which `wrap()` fills in; with none found, `wrap()` switches
      to `"cap"`), one for the other parameters;
    - `"patterns"`: one bucket per module-FQN pattern in `patterns`;
    - `"cap"`: graph order, at most `cap_bytes` per bucket;
    - `"auto"`: the cost model of `cost.py` for the device profile `device` picks the buckets
      (`plan_by_cost`), at most `cap_bytes` per bucket.
    `cap_bytes` counts the bytes one rank sends. Collectives on different process groups or in
    different dtypes never share a bucket (mixed dtypes split by dtype rather than travel as bytes:
    a bf16 and an fp32 bucket keep each collective's reduction in its own dtype).
    """

    plan: Literal["blocks", "patterns", "cap", "auto"] = "blocks"
    blocks: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    cap_bytes: int = 64 * 2**20
    device: str = "h100"
    bucket_all_gathers: bool = True
    bucket_reductions: bool = True

    def __post_init__(self) -> None:
        if self.plan not in ("blocks", "patterns", "cap", "auto"):
            raise ValueError(f"unknown bucket plan {self.plan!r}; expected 'blocks', 'patterns', 'cap' or 'auto'")
        if self.plan == "patterns" and not self.patterns:
            raise ValueError("the 'patterns' bucket plan needs patterns=(...), e.g. ('tok_embeddings', 'layers.*')")
        if self.cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be positive, got {self.cap_bytes}")
        cost.profile(self.device)  # an unknown profile name fails here, naming the known ones


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassConfig:
    """What simplefsdp's pass does to a wrapped model's compiled graphs.

    `bucket=None` turns bucketing off, `reorder=None` reordering; `wrap(model, passes=None)` turns
    the whole pass off (the graphs are then what torch traced: one collective per parameter,
    launched right before use).
    """

    bucket: BucketConfig | None = BucketConfig()
    reorder: ReorderConfig | None = ReorderConfig()


class FsdpPass(CustomGraphPass):
    """Buckets and reorders FSDP all-gathers and gradient reductions per `PassConfig`.

    A graph without FSDP collectives comes back unchanged. `graphs`, `merged` and `moved` count,
    over every graph this instance ran on, the graphs, the collectives merged away and the
    launches / waits moved (a compile-cache hit runs no pass and counts nothing).
    """

    def __init__(self, config: PassConfig | None = None, *, groups: Collection[tuple[int, ...]] | None = None) -> None:
        self.config = config or PassConfig()
        # the data-parallel process groups (their global ranks) whose collectives are FSDP's (None: any)
        self.groups = None if groups is None else frozenset(groups)
        self.graphs = 0
        self.merged = 0
        self.moved = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1
        merged = _bucket(graph, self.config.bucket, self.groups) if self.config.bucket is not None else 0
        moved = 0
        if self.config.reorder is not None:
            moved = reorder_all_gathers(graph, config=self.config.reorder, groups=self.groups)
            moved += reorder_reductions(graph, config=self.config.reorder, groups=self.groups)
        self.merged += merged
        self.moved += moved
        if merged or moved:
            graph.lint()
            logger.info("simplefsdp pass: merged away %d collectives, moved %d launches / waits", merged, moved)

    def uuid(self) -> str:
        # [Note: the rank is part of the cache key]
        # Inductor keys its FX graph cache on the graph *before* post-grad passes, plus this uuid.
        # The pass writes this rank's slot offset into the graph (the bucket copy-in and the view
        # the in-place all-gather sends), so two ranks whose incoming graphs are identical (even
        # shards, one group) would otherwise share a cache entry: on a warm cache shared by the
        # ranks of a host, rank 1 would run rank 0's code and send a buffer that overlaps the
        # wrong slot of the output. The global rank separates them; everything else in the key is
        # what the pass does. (On torch 2.13 the FX cache key of these graphs already differs
        # between two processes of the same rank -- an identical second compile misses -- so the
        # entry reused is AOTAutograd's, keyed per rank by [Note: per-rank AOTAutograd cache keys
        # for DTensor inputs]; the rank here keeps ranks apart should the FX key become stable.)
        groups = sorted(self.groups) if self.groups is not None else None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        key = f"simplefsdp-pass-{_VERSION}-{self.config}-{groups}-rank{rank}"
        return hashlib.sha256(key.encode()).hexdigest()


def _bucket(graph: fx.Graph, config: BucketConfig, groups: frozenset[tuple[int, ...]] | None) -> int:
    removed = 0
    if config.bucket_all_gathers:
        gathers = find_fsdp_all_gathers(graph, groups=groups)
        removed += apply_all_gather_buckets(graph, gathers, plan_buckets(graph, gathers, config))
    if config.bucket_reductions:
        reductions = find_fsdp_reductions(graph, groups=groups)
        removed += apply_reduction_buckets(graph, reductions, plan_buckets(graph, reductions, config))
    return removed


def _merge_key(collective: Collective) -> MergeKey:
    return MergeKey(
        kind=collective.kind,
        group_name=collective.group_name,
        group_size=collective.group_size,
        dtype=collective.dtype,
        reduce_op=collective.reduce_op,
    )


def plan_buckets(graph: fx.Graph, found: list[Collective], config: BucketConfig) -> list[Bucket]:
    """The buckets `config`'s plan makes of `found` (collectives of `graph`, in graph order), checked."""
    candidates = [Candidate(index=i, key=_merge_key(c), nbytes=c.nbytes, owner=c.owner) for i, c in enumerate(found)]
    if config.plan == "blocks":
        buckets = plan_by_blocks(candidates, blocks=config.blocks)
    elif config.plan == "patterns":
        buckets = plan_by_patterns(candidates, patterns=config.patterns)
    elif config.plan == "cap":
        buckets = plan_by_cap(candidates, cap_bytes=config.cap_bytes)
    else:
        device = cost.profile(config.device)

        def comm_s(key: MergeKey, nbytes: int) -> float:
            full = nbytes * key.group_size if key.kind == "all_gather" else nbytes
            return cost.collective_seconds(device, kind=key.kind, nbytes=full, world=key.group_size)

        windows = cost.compute_between(device, graph, [c.launch for c in found]) if found else [0.0]
        buckets = plan_by_cost(candidates, windows_s=windows, comm_s=comm_s, cap_bytes=config.cap_bytes)
    check_plan(candidates, buckets)
    return buckets
