"""Bucket plans: which FSDP collectives merge into one. Pure functions, no graph mutation.

A plan is a list of `Bucket`s over `Candidate`s (the collectives `detect.py` finds, in graph
order). Four ways to plan:

- `plan_by_blocks`  (default, zero configuration): one bucket per repeated block of the model
  (`simplefsdp.blocks.find_repeated_blocks`: the children of a container of identical modules) and
  one per run of the parameters outside them, split where a block comes between (in a Llama-style
  model: the embedding before the blocks, the final norm and output after them; see
  [Note: the rest, by runs]);
- `plan_by_patterns` (manual): one bucket per entry of a list of module-FQN patterns, e.g.
  `["tok_embeddings", "layers.*", "norm+output"]` (`*` matches within one FQN level per block, `+`
  joins alternatives into one bucket; `simplefsdp.blocks.match_pattern`);
- `plan_by_cap` (size-driven): candidates in graph order, per merge key, up to a byte cap;
- `plan_by_cost` (auto): contiguous runs per merge key chosen by dynamic programming to minimise
  the communication a cost model (`cost.py`) says is left exposed, under a byte cap.

The planners read candidates only: sizes, merge keys, owners (parameter FQNs). Which blocks or
patterns a model has is the caller's input (`simplefsdp/blocks.py` reads the model).

Invariants of every plan (checked by `check_plan`, and by hypothesis in the tests):
- it partitions the candidates: each is in exactly one bucket;
- members of a bucket share a merge key (collective kind, process group, dtype): collectives on
  different groups or in different dtypes are never merged;
- order is preserved: members ascend within a bucket, buckets ascend by first member;
- decisions depend only on the candidates (never on rank or timing), so every rank plans alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from simplefsdp.blocks import block_of, match_pattern

__all__ = [
    "Bucket",
    "Candidate",
    "MergeKey",
    "check_plan",
    "exposed_seconds",
    "plan_by_blocks",
    "plan_by_cap",
    "plan_by_cost",
    "plan_by_patterns",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeKey:
    """What collectives must share to merge into one: the same kind of collective, on the same
    process group, in the same dtype, with the same reduce op -- and quantized gathers the same code
    type, block and output dtype (one `quant_copy_out` dequantizes a whole bucket)."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    group_name: str
    group_size: int
    dtype: torch.dtype
    reduce_op: str | None = None  # None for all-gathers
    quantized: tuple[torch.dtype, int, torch.dtype] | None = None  # (code dtype, block, output dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One collective the planner may bucket."""

    index: int  # position in graph order
    key: MergeKey  # only candidates with equal keys may share a bucket
    nbytes: int  # bytes this rank sends
    owner: str = ""  # fully qualified name of the parameter, "" if unknown


@dataclasses.dataclass(frozen=True)
class Bucket:
    members: tuple[int, ...]  # candidate indices, ascending


def _split_by_key(group: Sequence[Candidate]) -> list[Bucket]:
    """One bucket per merge key within `group`, each in graph order."""
    by_key: dict[MergeKey, list[int]] = {}
    for cand in sorted(group, key=lambda c: c.index):
        by_key.setdefault(cand.key, []).append(cand.index)
    return [Bucket(tuple(members)) for members in by_key.values()]


def _ordered(buckets: list[Bucket]) -> list[Bucket]:
    return sorted((b for b in buckets if b.members), key=lambda b: b.members[0])


def plan_by_blocks(candidates: Sequence[Candidate], *, blocks: Sequence[str]) -> list[Bucket]:
    """One bucket per block prefix in `blocks`, one per run of the other candidates between blocks in
    graph order (each split by merge key).

    [Note: the rest, by runs]
    One bucket for every parameter outside the blocks (what FSDP2's root group does) gathers the
    output projection with the embedding at the start of the forward and keeps it until the end, and
    the embedding with the output through the whole backward: at a Llama-3-8B shape, 1 GiB of bf16
    weight held across the activation peak. A run ends where a block's candidate comes, so what is
    used before the blocks and what is used after them are gathered (and reduced) where they are used.
    Measured on an H200 (`bench/gpu_check.py`: 2 Llama-3-8B-shaped blocks, world 8 on the fake group):
    the default passes peaked at 10.27 GiB with one rest bucket and 7.51 GiB with the runs, at the
    same step time (33.2 and 33.1 ms); FSDP2 eager, which gathers its root group whole, 9.52 GiB."""
    groups: dict[str, list[Candidate]] = {block: [] for block in blocks}
    runs: list[list[Candidate]] = [[]]
    for cand in sorted(candidates, key=lambda c: c.index):
        block = block_of(cand.owner, blocks)
        if block is None:
            runs[-1].append(cand)
        else:
            groups[block].append(cand)
            if runs[-1]:
                runs.append([])
    return _ordered([b for group in [*groups.values(), *runs] for b in _split_by_key(group)])


def plan_by_patterns(candidates: Sequence[Candidate], *, patterns: Sequence[str]) -> list[Bucket]:
    """One bucket per pattern; a candidate joins the first pattern matching its owner's FQN or a prefix of it.

    `"layers.*"` gives one bucket *per matched block* (`layers.0`, `layers.1`, ...); `"norm+output"`
    one bucket for both. Candidates no pattern matches form one last bucket. A graph may hold only
    some parameters' collectives (the backward re-gathers no embedding), so a pattern matching no
    candidate is fine here; `validate_patterns` checks patterns against the model's parameters.
    """
    groups: dict[tuple[int, str], list[Candidate]] = {}
    rest: list[Candidate] = []
    for cand in candidates:
        hit = match_pattern(cand.owner, patterns)
        if hit is None:
            rest.append(cand)
        else:
            groups.setdefault(hit, []).append(cand)
    return _ordered([b for group in [*groups.values(), rest] for b in _split_by_key(group)])


def plan_by_cap(candidates: Sequence[Candidate], *, cap_bytes: int) -> list[Bucket]:
    """Greedy in graph order, one open bucket per merge key: a candidate joins its key's open bucket
    while that stays within `cap_bytes`, else it opens a new one. A candidate larger than the cap
    gets a bucket of its own. Keys interleave freely (HYBRID alternates all-reduce / reduce-scatter).
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    buckets: list[list[Candidate]] = []
    open_bucket: dict[MergeKey, list[Candidate]] = {}
    for cand in sorted(candidates, key=lambda c: c.index):
        current = open_bucket.get(cand.key)
        if current is not None and sum(c.nbytes for c in current) + cand.nbytes <= cap_bytes:
            current.append(cand)
        else:
            open_bucket[cand.key] = [cand]
            buckets.append(open_bucket[cand.key])
    return _ordered([Bucket(tuple(c.index for c in bucket)) for bucket in buckets])


_MAX_BUCKET_LEN = 64  # bounds the dynamic program's work at O(n * 64^2) per merge key


def plan_by_cost(
    candidates: Sequence[Candidate],
    *,
    windows_s: Sequence[float],
    comm_s: Callable[[MergeKey, int], float],
    cap_bytes: int,
    overlap: float = 1.0,
    fixed_s: Callable[[MergeKey, int, int], float] | None = None,
) -> list[Bucket]:
    """Buckets that minimise the communication a cost model says is left exposed.

    `candidates` are in graph order; `windows_s` has one more entry than they do: the seconds of
    compute before the first candidate, between each two and after the last (`cost.compute_between`).
    `comm_s(key, nbytes)` is the seconds of one collective of that key in which each rank sends `nbytes`.

    The model: each bucket's collective runs behind the compute attributed to the bucket that runs
    before it (prefetch depth 1). An all-gather is needed by the compute after it, so its candidate's
    compute is the window after it and buckets are taken in graph order: bucket k is prefetched
    during bucket k - 1's compute. A reduction is launched after the compute that produced its
    gradients and runs behind the compute that follows, so its candidate's compute is the window
    before it and buckets are taken in reverse: the bucket launched last overlaps nothing, each
    earlier one the compute of the bucket after it.

    Per merge key, over that key's candidates in that order, a bucket `[s, e)` costs
    `max(0, c - w) + (1 - overlap) * min(c, w)` with `c = comm_s(bytes[s:e])` and `w = compute[p:s]`,
    `[p, s)` the bucket before it (the first overlaps nothing: `w = 0`), plus `fixed_s(key, bytes,
    members)` -- what a bucket costs the step whatever runs beside it (issuing the collective, the
    copy ops' calls: `auto_plan.bucket_fixed_seconds`; none if not given) -- plus a tiny charge per
    bucket so ties prefer fewer collectives. `overlap` is the share of communication time that
    really runs in parallel with compute (`DeviceProfile.overlap`). Buckets stay
    within `cap_bytes` (a single oversize candidate gets its own) and hold at most 64 members.
    Deterministic: it reads only its arguments.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    if len(windows_s) != len(candidates) + 1:
        raise ValueError(f"windows_s has {len(windows_s)} entries for {len(candidates)} candidates (expected one more)")
    if [c.index for c in candidates] != sorted(c.index for c in candidates):
        raise ValueError("plan_by_cost takes candidates in graph order")
    buckets = []
    for key, positions, compute in _planning_order(candidates, windows_s):
        sizes = [candidates[p].nbytes for p in positions]
        fixed = (lambda n, m, key=key: fixed_s(key, n, m)) if fixed_s is not None else _no_fixed
        for s, e in _best_runs(sizes, compute, lambda n, key=key: comm_s(key, n), fixed, cap_bytes, overlap):
            buckets.append(Bucket(tuple(sorted(candidates[p].index for p in positions[s:e]))))
    return _ordered(buckets)


def _planning_order(
    candidates: Sequence[Candidate], windows_s: Sequence[float]
) -> list[tuple[MergeKey, list[int], list[float]]]:
    """Per merge key: the key's candidate positions in planning order and each one's compute (see
    `plan_by_cost`: all-gathers in graph order with the window after them, reductions in reverse
    with the window before them)."""
    by_key: dict[MergeKey, list[int]] = {}
    for position, cand in enumerate(candidates):
        by_key.setdefault(cand.key, []).append(position)
    order = []
    for key, positions in by_key.items():
        if key.kind == "all_gather":
            order.append((key, positions, [windows_s[p + 1] for p in positions]))
        else:
            order.append((key, positions[::-1], [windows_s[p] for p in positions[::-1]]))
    return order


def exposed_seconds(
    candidates: Sequence[Candidate],
    buckets: Sequence[Bucket],
    *,
    windows_s: Sequence[float],
    comm_s: Callable[[MergeKey, int], float],
    overlap: float = 1.0,
    fixed_s: Callable[[MergeKey, int, int], float] | None = None,
) -> float:
    """The seconds of communication `buckets` leave exposed under `plan_by_cost`'s model, its fixed
    charges included (without its tie-breaking charge): what the auto plan minimises, for any plan
    of `candidates`."""
    index_of = {c.index: position for position, c in enumerate(candidates)}
    bucket_of = {index_of[i]: b for b, bucket in enumerate(buckets) for i in bucket.members}
    total = 0.0
    for key, positions, compute in _planning_order(candidates, windows_s):
        runs: list[tuple[int, int, float, int]] = []  # (bucket, bytes, compute, members) in planning order
        for position, seconds in zip(positions, compute, strict=True):
            b, nbytes = bucket_of[position], candidates[position].nbytes
            if runs and runs[-1][0] == b:
                runs[-1] = (b, runs[-1][1] + nbytes, runs[-1][2] + seconds, runs[-1][3] + 1)
            else:
                runs.append((b, nbytes, seconds, 1))
        for k, (_, nbytes, _, members) in enumerate(runs):
            total += _exposed(comm_s(key, nbytes), runs[k - 1][2] if k else 0.0, overlap)
            total += fixed_s(key, nbytes, members) if fixed_s is not None else 0.0
    return total


def _no_fixed(nbytes: int, members: int) -> float:
    return 0.0


def _best_runs(
    sizes: list[int],
    compute: list[float],
    comm: Callable[[int], float],
    fixed: Callable[[int, int], float],
    cap: int,
    overlap: float,
) -> list[tuple[int, int]]:
    """Dynamic program of `plan_by_cost` over one key's candidates: the runs `[s, e)` it picks."""
    n, tie = len(sizes), 1e-12
    prefix_bytes, prefix_compute = [0], [0.0]
    for size, seconds in zip(sizes, compute, strict=True):
        prefix_bytes.append(prefix_bytes[-1] + size)
        prefix_compute.append(prefix_compute[-1] + seconds)

    def fits(s: int, e: int) -> bool:
        return e - s == 1 or (e - s <= _MAX_BUCKET_LEN and prefix_bytes[e] - prefix_bytes[s] <= cap)

    # best[(s, e)]: least cost of covering [0, e) with last bucket [s, e); parent[(s, e)]: the bucket before
    best: dict[tuple[int, int], float] = {}
    parent: dict[tuple[int, int], tuple[int, int] | None] = {}
    for e in range(1, n + 1):
        for s in range(max(0, e - _MAX_BUCKET_LEN), e):
            if not fits(s, e):
                continue
            nbytes = prefix_bytes[e] - prefix_bytes[s]
            comm_here, fixed_here = comm(nbytes), fixed(nbytes, e - s) + tie
            if s == 0:
                best[(s, e)], parent[(s, e)] = comm_here + fixed_here, None
                continue
            options = [
                (best[(p, s)] + _exposed(comm_here, prefix_compute[s] - prefix_compute[p], overlap), (p, s))
                for p in range(max(0, s - _MAX_BUCKET_LEN), s)
                if (p, s) in best
            ]
            least, before = min(options)
            best[(s, e)], parent[(s, e)] = least + fixed_here, before
    last = min((cost, run) for run, cost in best.items() if run[1] == n)[1] if n else None
    runs = []
    while last is not None:
        runs.append(last)
        last = parent[last]
    return runs[::-1]


def _exposed(comm: float, compute: float, overlap: float) -> float:
    """Seconds a collective of `comm` seconds costs the step when `compute` seconds can run beside it."""
    hidden = min(comm, compute)
    return comm - hidden + (1.0 - overlap) * hidden


def check_plan(candidates: Sequence[Candidate], buckets: Sequence[Bucket]) -> None:
    """Raise `RuntimeError` naming the broken invariant (see the module docstring). A planner's bug
    caught here, before the graph changes, is an error; missed, it would be a hang or lost gradients."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise RuntimeError(f"simplefsdp bucket plan: {what}")

    by_index = {c.index: c for c in candidates}
    members = [i for b in buckets for i in b.members]
    require(sorted(members) == sorted(by_index), "a plan must partition the candidates")
    for bucket in buckets:
        require(list(bucket.members) == sorted(bucket.members), f"bucket {bucket} is out of graph order")
        keys = {by_index[i].key for i in bucket.members}
        require(len(keys) == 1, f"bucket {bucket} mixes merge keys {keys}")
    firsts = [b.members[0] for b in buckets]
    require(firsts == sorted(firsts), "buckets must be ordered by their first member")
