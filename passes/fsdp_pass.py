"""simplefsdp's post-grad pass: detect -> plan -> bucket -> reorder, as an inductor `CustomGraphPass`.

`simplefsdp.wrap()` installs one `FsdpPass` per wrapped model for the compiles of that model
(see `install.py`); `PassConfig` is what a user picks (`wrap(model, passes=PassConfig(...))`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.metadata
import logging
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import fx

from simplefsdp._compat import CustomGraphPass
from simplefsdp.passes import cost
from simplefsdp.passes.auto_plan import plan_auto
from simplefsdp.passes.backend import cache_tag
from simplefsdp.passes.bucket import apply_all_gather_buckets, apply_reduction_buckets
from simplefsdp.passes.collectives import Collective, merge_repeated_waits
from simplefsdp.passes.detect import find_fsdp_all_gathers, find_fsdp_reductions
from simplefsdp.passes.liveness import peak_bytes
from simplefsdp.passes.plan import (
    Bucket,
    Candidate,
    MergeKey,
    check_plan,
    plan_by_blocks,
    plan_by_cap,
    plan_by_patterns,
)
from simplefsdp.passes.reorder import ReorderConfig, ReorderResult, reorder
from simplefsdp.passes.uneven import fold_uneven_reductions
from simplefsdp.settings import parse_memory_budget

__all__ = ["BucketConfig", "FsdpPass", "PassConfig", "parse_memory_budget", "plan_buckets"]

logger = logging.getLogger(__name__)


def source_digest(files: Iterable[Path]) -> str:
    """A SHA-256 over the names and bytes of `files` (order-independent): equal iff every file's
    name and contents are."""
    digest = hashlib.sha256()
    for path in sorted(Path(f) for f in files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """What, besides its configuration, decides what the pass writes into a graph: the source of the
    passes and kernels packages (the ops it inserts and their signatures), `_compat.py` (the torch APIs
    it reaches), and the simplefsdp and torch versions. See [Note: what keys the compile cache]."""
    from simplefsdp import _compat, kernels

    files = [*Path(__file__).parent.glob("*.py"), *Path(kernels.__file__).parent.glob("*.py"), Path(_compat.__file__)]
    return f"{importlib.metadata.version('simplefsdp')}-{torch.__version__}-{source_digest(files)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """Which plan (see `plan.py`) decides the buckets.

    - `"blocks"` (default): one bucket per repeated block in `blocks` (e.g. from
      `simplefsdp.blocks.find_repeated_blocks(model)`, which `wrap()` fills in; with none found, `wrap()` switches
      to `"cap"`), one for the other parameters;
    - `"patterns"`: one bucket per module-FQN pattern in `patterns`;
    - `"cap"`: graph order, at most `cap_bytes` per bucket;
    - `"auto"`: the cost model of `cost.py` for the device profile `device` (a name or a
      `simplefsdp calibrate` file) picks the buckets and the all-gathers' prefetch depth
      (`auto_plan.py`), at most `cap_bytes` per bucket and within `memory_budget`: the bytes the
      pass may add to a graph's peak (an int), or that as a fraction of the graph's own peak (a
      float, e.g. 0.25); None: no budget beyond `cap_bytes`.
    `cap_bytes` counts the bytes one rank sends. Collectives on different process groups or in
    different dtypes never share a bucket (mixed dtypes split by dtype rather than travel as bytes:
    a bf16 and an fp32 bucket keep each collective's reduction in its own dtype).
    """

    plan: Literal["blocks", "patterns", "cap", "auto"] = "blocks"
    blocks: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    cap_bytes: int = 64 * 2**20
    device: str = "h100"
    memory_budget: int | float | None = None
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
        if self.memory_budget is not None:
            if self.plan != "auto":
                raise ValueError(f"memory_budget is for the 'auto' plan; the {self.plan!r} plan takes no budget")
            if isinstance(self.memory_budget, bool) or not self.memory_budget > 0:
                raise ValueError(
                    f"memory_budget must be positive bytes or a positive fraction, got {self.memory_budget!r}"
                )

    def budget_bytes(self, graph_peak: int) -> int | None:
        """`memory_budget` in bytes for a graph whose peak is `graph_peak` (None: no budget)."""
        if self.memory_budget is None:
            return None
        if isinstance(self.memory_budget, float):
            return int(self.memory_budget * graph_peak)
        return int(self.memory_budget)


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
    launches / waits moved; `reorders` holds each reordered graph's `ReorderResult` (peak live
    bytes before and after, within the memory budget). A compile-cache hit runs no pass and
    counts nothing.
    """

    def __init__(self, config: PassConfig | None = None, *, groups: Collection[tuple[int, ...]] | None = None) -> None:
        self.config = config or PassConfig()
        # the data-parallel process groups (their global ranks) whose collectives are FSDP's (None: any)
        self.groups = None if groups is None else frozenset(groups)
        self.graphs = 0
        self.merged = 0
        self.moved = 0
        self.reorders: list[ReorderResult] = []  # per graph reordered: peaks before / after, budgets

    def __call__(self, graph: fx.Graph) -> None:
        with _collector_paused():
            self._run(graph)

    def _run(self, graph: fx.Graph) -> None:
        self.graphs += 1
        merge_repeated_waits(graph)  # [Note: a launch with two waits]
        folded = fold_uneven_reductions(graph)  # [Note: why fold the uneven padding]
        merged, depth = _bucket(graph, self.config.bucket, self.groups) if self.config.bucket is not None else (0, None)
        moved = 0
        if self.config.reorder is not None:
            config = self.config.reorder
            if depth is not None:  # the auto plan chose the gathers' prefetch depth for this graph
                config = dataclasses.replace(config, prefetch_depth=depth)
            result = reorder(graph, config=config, groups=self.groups)
            self.reorders.append(result)
            moved = result.moved
        self.merged += merged
        self.moved += moved
        # not linted here: inductor lints after its post-grad passes, aot_eager after ours
        if merged or moved or folded:
            logger.info(
                "simplefsdp pass: folded the padding of %d uneven gradients, merged away %d collectives, "
                "moved %d launches / waits",
                folded,
                merged,
                moved,
            )

    def uuid(self) -> str:
        # [Note: the rank is not part of the cache key]
        # Inductor keys its FX graph cache on the graph *before* post-grad passes, plus this uuid.
        # The pass writes no rank into the graph ([Note: no rank in the graph] in `bucket.py`): its
        # output is a function of its input graph and of what this key holds, so two ranks whose
        # incoming graphs are identical (even shards on a 1-D mesh) may share a cache entry, and
        # one compiled artifact serves them all. Ranks whose graphs differ (an uneven shard's local
        # shape, a 2-D mesh's group names) differ before the pass already, in the FX graph and in
        # the AOTAutograd key ([Note: per-rank AOTAutograd cache keys for DTensor inputs]).
        groups = sorted(self.groups) if self.groups is not None else None
        profile = None  # a profile file's numbers, not just its path, decide the auto plan
        if self.config.bucket is not None and self.config.bucket.plan == "auto":
            profile = cost.profile(self.config.bucket.device)
        # [Note: what keys the compile cache]
        # Inductor's caches outlive an upgrade: a graph compiled by an older pass would be served to
        # a newer one whenever the incoming graph is the same. A hand-bumped version string was
        # forgotten too often, so the key carries a digest of the code that decides the pass's
        # output (`code_fingerprint`): any edit to the passes or kernels, or another torch or
        # simplefsdp version, is a miss.
        # the backend decides how a reduce-scatter bucket is issued ([Note: gloo's reduce-scatter is an
        # all-reduce of a copy]); the groups' backends are the default group's in every use here
        backend = cache_tag()
        key = f"simplefsdp-pass-{code_fingerprint()}-{self.config}-{profile}-{groups}-{backend}"
        return hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the pass runs (back on after, if it was on).

    [Note: the collector paused during the pass]
    The pass allocates tens of thousands of small containers (tuples, lists, dicts of nodes) that
    all live until it returns; every few hundred of them trigger a collection, and now and then a
    full one, which traverses every object of the compile -- graphs, fake tensors, guards -- to free
    next to nothing: in a 64-block model's compile, paused, the backward's pass takes a third of the
    time (bench/results/measurements.md, "the collector paused"). Garbage made meanwhile is
    collected later, as usual. torch's distributed state-dict helpers pause it for the same reason.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _bucket(graph: fx.Graph, config: BucketConfig, groups: frozenset[tuple[int, ...]] | None) -> tuple[int, int | None]:
    """Merge the planned buckets; returns (collectives removed, the prefetch depth the auto plan chose
    for the gathers, or None)."""
    removed, depth = 0, None
    budget = config.budget_bytes(peak_bytes(graph) if isinstance(config.memory_budget, float) else 0)
    if config.bucket_all_gathers:
        gathers = find_fsdp_all_gathers(graph, groups=groups)
        buckets, depth = plan_buckets(graph, gathers, config, budget_bytes=budget)
        removed += apply_all_gather_buckets(graph, gathers, buckets)
    if config.bucket_reductions:
        reductions = find_fsdp_reductions(graph, groups=groups)
        buckets, _ = plan_buckets(graph, reductions, config, budget_bytes=budget)
        removed += apply_reduction_buckets(graph, reductions, buckets)
    return removed, depth


def _merge_key(collective: Collective) -> MergeKey:
    return MergeKey(
        kind=collective.kind,
        group_name=collective.group_name,
        group_size=collective.group_size,
        dtype=collective.dtype,
        reduce_op=collective.reduce_op,
        quantized=_quantized_key(collective),
    )


def _quantized_key(collective: Collective) -> tuple[torch.dtype, int, torch.dtype] | None:
    """A quantized gather's (code dtype, block, output dtype), read from its `quant_copy_out`."""
    dequantize = getattr(collective, "dequantize", None)
    if dequantize is None:
        return None
    *_, code_dtype, block, dtype = dequantize.args
    return code_dtype, block, dtype


def plan_buckets(
    graph: fx.Graph, found: list[Collective], config: BucketConfig, *, budget_bytes: int | None = None
) -> tuple[list[Bucket], int | None]:
    """The buckets `config`'s plan makes of `found` (collectives of `graph`, in graph order), checked,
    and the all-gathers' prefetch depth when the plan chooses it (auto), else None."""
    candidates = [Candidate(index=i, key=_merge_key(c), nbytes=c.nbytes, owner=c.owner) for i, c in enumerate(found)]
    depth = None
    if config.plan == "blocks":
        buckets = plan_by_blocks(candidates, blocks=config.blocks)
    elif config.plan == "patterns":
        buckets = plan_by_patterns(candidates, patterns=config.patterns)
    elif config.plan == "cap":
        buckets = plan_by_cap(candidates, cap_bytes=config.cap_bytes)
    else:
        auto = plan_auto(
            graph,
            found,
            candidates,
            device=cost.profile(config.device),
            cap_bytes=config.cap_bytes,
            budget_bytes=budget_bytes,
        )
        buckets, depth = auto.buckets, auto.prefetch_depth
    check_plan(candidates, buckets)
    return buckets, depth
