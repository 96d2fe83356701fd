"""Reorder FSDP collectives so communication overlaps compute.

All-gathers (forward, and the backward's re-gathers under FULL_SHARD), in order of first use
`g_0, g_1, ...`:

    launch g_0 .. g_d | wait g_0, compute 0 | launch g_{d+1}, wait g_1, compute 1 | ...

the all-gather of `g_{i+d}` (prefetch depth `d`, default 1) and its copy-in are launched right
before `g_i` is waited (so before `g_i`'s compute), and every wait sits right before the first
op that uses its result. Gradient reductions (reduce-scatters, all-reduces): each is launched as
soon as its last input gradient exists and waited as late as allowed -- right before the first
real use of its result (usually the graph's output), or earlier when the reductions in flight
would otherwise hold more than the memory budget.

[Note: what a move may carry]
Only cheap data-movement ops move with a collective: the launch chain of an all-gather (its
casts, pads, reshapes and the bucket's concat, back to graph inputs), the launch chain of a
reduction (its casts, reshapes and concat, back to the ops that computed the gradients) and a
wait's landing chain (the copy-out and views that unpack a bucket). An all-gather whose input depends on real
compute (not a parameter's shard) is not prefetched. So a move never drags compute across the
graph and every move keeps the graph topologically sorted.

[Note: one order on every rank]
Decisions use only the graph's structure and its tensors' global-per-collective sizes (the
gathered output, the full gradient), which are equal on every rank: a rank holding a smaller
shard of an uneven parameter has an extra pad node, but pads travel in launch chains, and the
relative order of all other nodes is the same everywhere. So every rank issues its collectives
in the same order (a mismatch would hang).

[Note: the memory budget]
Prefetching `g_{i+d}` keeps `d` extra gathered buffers alive during `g_i`'s compute: the depth for a
given gather shrinks until those buffers fit the gathers' budget. A reduction is waited before
launching the one that would make the inputs of the reductions in flight exceed the reductions'
budget (a collective's input stays alive until its wait). `ReorderConfig.max_in_flight_bytes=None`
(the default) derives both from the graph: the gathers get `prefetch_depth` times the largest
gathered bucket, the reductions the largest reduction's input -- so one reduction is in flight at a
time unless two fit in that. A number gives each kind that many bytes. The copies of offloaded
shards to and from host memory are placed last ([Note: where offload copies sit] in `host_copies.py`).
`reorder()` then checks the result with the liveness walk (`liveness.py`): the graph's peak live
bytes may grow by at most the allowance (`max_peak_growth_bytes` when set; else explicit:
`max_in_flight_bytes`; derived: the two budgets' sum). If it grew more, the moves are undone and
retried with a quarter of the budget, then with none; if that still does not fit, the graph keeps
its original order.

[Note: placing by slack]
A graph's live bytes rise and fall: a forward holds few activations early on, a backward frees
them block by block while the reduced gradients pile up. A prefetch or a late wait costs nothing
where the live bytes sit below the graph's peak. So each attempt first puts the graph in a
baseline order (nothing prefetched, gathers waited at first use, each reduction waited right
after its launch), walks it once, and then places collectives one by one, in order: a gather is
prefetched only as far back as the live bytes along the way, plus its gathered buffer and
copy-in, stay under the cap (`peak_before + allowance`); a reduction's wait is delayed past the
next reductions' launches only while its input fits under the cap the same way. Each placement
is counted in the walk's totals before the next is decided (one walk, then interval updates;
no walk per candidate). `max_peak_growth_bytes=0` asks for overlap that costs no peak memory
at all; the default (None) allows the in-flight budgets' sum. The final walk still checks the
result, as above (the placements assume the other nodes' buffers keep their baseline lifetimes).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Collection, Iterable

from torch import fx

from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_OUT
from simplefsdp.kernels.quant_ops import QUANT_COPY_OUT
from simplefsdp.passes.collectives import find_collectives, is_data_movement, is_slot_copy
from simplefsdp.passes.detect import find_fsdp_reductions
from simplefsdp.passes.host_copies import place_host_copies
from simplefsdp.passes.liveness import Lifetimes, allocates, nbytes, not_alike
from simplefsdp.passes.walk import upstream, walk

__all__ = ["ReorderConfig", "ReorderResult", "reorder", "reorder_all_gathers", "reorder_reductions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReorderConfig:
    """How far ahead to launch collectives (see the module docstring)."""

    prefetch_depth: int = 1  # all-gathers launched ahead of the one being waited
    # extra bytes reordering may keep alive (prefetched gathered buffers, inputs of reductions in
    # flight); None: derived from each graph, see [Note: the memory budget]
    max_in_flight_bytes: int | None = None
    # how far reordering may raise the graph's peak live bytes over the order it was given; None: by
    # the in-flight budgets (their sum, or `max_in_flight_bytes`), see [Note: placing by slack]
    max_peak_growth_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.max_in_flight_bytes is not None and self.max_in_flight_bytes <= 0:
            raise ValueError(f"max_in_flight_bytes must be positive or None, got {self.max_in_flight_bytes}")
        if self.max_peak_growth_bytes is not None and self.max_peak_growth_bytes < 0:
            raise ValueError(f"max_peak_growth_bytes must be >= 0 or None, got {self.max_peak_growth_bytes}")


def _is_unpack(node: fx.Node) -> bool:
    """An op that unpacks a waited result: a view (`reshape`, `getitem`, `slice`, ...), the bucket
    copy-out (plain or quantized), or the slot copy of a gloo reduction bucket (`is_slot_copy`)."""
    if node.op != "call_function":
        return False
    return (
        node.target is operator.getitem
        or node.target in (ALL_GATHER_COPY_OUT, QUANT_COPY_OUT)
        or bool(getattr(node.target, "is_view", False))
        or is_slot_copy(node)
    )


# [Note: node order] FX nodes compare by their position in the graph (`a < b`: `a` comes first),
# kept up to date as nodes move, so the passes never rebuild a position table after a move.


def _move_before(anchor: fx.Node, nodes: Iterable[fx.Node]) -> None:
    for node in sorted(nodes):
        anchor.prepend(node)


def _gather_launch_chain(launch: fx.Node) -> list[fx.Node] | None:
    """The data-movement ops from graph inputs to an all-gather's input, or None if real compute feeds it."""
    region = upstream(launch, through=is_data_movement)
    if any(node.op not in ("placeholder", "get_attr") for node in region.boundary):
        return None
    return region.inside


def _reduction_launch_chain(launch: fx.Node) -> list[fx.Node]:
    """The data-movement ops between the gradients' producers and a reduction's input."""
    return upstream(launch, through=is_data_movement).inside


def _landing(wait: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(unpacking ops fed only by `wait` and each other, the other users of wait and those ops)."""
    landing = {wait}

    def follow(node: fx.Node) -> Iterable[fx.Node]:
        if node is wait or (_is_unpack(node) and all(i in landing for i in node.all_input_nodes)):
            landing.add(node)
            return node.users
        return ()

    reached = list(walk([wait], follow=follow))  # classifies as it goes: read `landing` once done
    consumers = [node for node in reached if node not in landing]
    landing.discard(wait)
    return list(landing), consumers


def _after_landing(wait: fx.Node, landing: list[fx.Node]) -> fx.Node:
    """The first node after `wait` and the landing nodes that directly follow it."""
    node, skip = wait.next, set(landing)
    while node in skip:
        node = node.next
    return node


def _out_bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.dtype.itemsize


# [Note: found once, placed many times] A collective's launch chain, landing and consumers are
# sets of nodes that moves do not change (moves keep the nodes and their edges), so `reorder` finds
# them once and every attempt's baseline and placements reuse them; what depends on the order (the
# first consumer, which launch comes first) is read from the graph when it is needed.


@dataclasses.dataclass(frozen=True)
class _Movable:
    """A collective the reorder places, with what moves along with it."""

    launch: fx.Node
    wait: fx.Node
    # a gather: the data movement from graph inputs to its launch; a reduction: the data movement
    # from the gradients' producers, and the launch itself
    chain: list[fx.Node]
    landing: list[fx.Node]  # the wait's unpacking ops
    consumers: list[fx.Node]  # the other users of the wait and of its landing
    size: int  # bytes gathered / sent (the full gradient)


def _prefetchable_gathers(graph: fx.Graph, groups: Collection[tuple[int, ...]] | None) -> list[_Movable]:
    """All-gathers on `groups` (another parallelism's, e.g. tensor parallel's, are not ours to move)
    whose input is data movement from graph inputs, with their wait and its users."""
    found = []
    for gather in find_collectives(graph, kinds=("all_gather",), groups=groups):
        if gather.wait is None:
            continue
        chain = _gather_launch_chain(gather.launch)
        landing, consumers = _landing(gather.wait)
        if chain is None or not consumers:
            continue
        found.append(_Movable(gather.launch, gather.wait, chain, landing, consumers, _out_bytes(gather.wait)))
    return found


def _fsdp_reductions(graph: fx.Graph, groups: Collection[tuple[int, ...]] | None) -> list[_Movable]:
    """The gradient reductions (`detect.find_fsdp_reductions`) with their chains and landings."""
    found = []
    for r in find_fsdp_reductions(graph, groups=groups):
        landing, consumers = _landing(r.wait)
        chain = [*_reduction_launch_chain(r.launch), r.launch]
        found.append(_Movable(r.launch, r.wait, chain, landing, consumers, _out_bytes(r.sent)))
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReorderResult:
    """What `reorder` did to one graph (peaks from the liveness walk, in bytes)."""

    moved: int  # collectives placed away from the baseline order: gathers prefetched, reduction waits delayed
    peak_before: int
    peak_after: int
    allowance: int  # how much the peak was allowed to grow
    budgets: tuple[int, int]  # (gathers, reductions) of the attempt kept


_RETRY_FRACTIONS = (1.0, 0.25, 0.0)  # of the budget, tried in turn while the peak grows too much


class _Room:
    """Live bytes along a graph in its baseline order, and the cap they must stay under
    ([Note: placing by slack]). Positions are the baseline's: moves made afterwards do not shift them."""

    def __init__(self, lifetimes: Lifetimes, *, skip: Collection[fx.Node], cap: int) -> None:
        along = lifetimes.along()
        self.position = {node: i for i, node in enumerate(along)}
        self.live = list(along.values())
        self.skip = skip
        self.cap = cap

    def held(self, nodes: Iterable[fx.Node]) -> int:
        """Bytes of the buffers `nodes` allocate that the walk counts."""
        return sum(nbytes(node) for node in nodes if node not in self.skip and allocates(node))

    def take(self, first: fx.Node, last: fx.Node, extra: int) -> bool:
        """Whether `extra` more bytes may stay live from `first` up to (not including) `last` in the
        baseline order without passing the cap; if so, they are counted from now on."""
        start, stop = self.position[first], self.position[last]
        if start >= stop or extra <= 0:
            return True
        if max(self.live[start:stop]) + extra > self.cap:
            return False
        for i in range(start, stop):
            self.live[i] += extra
        return True


def reorder(
    graph: fx.Graph, *, config: ReorderConfig, groups: Collection[tuple[int, ...]] | None = None
) -> ReorderResult:
    """Prefetch all-gathers and launch reductions early within the memory budget, checked with the
    liveness walk ([Note: the memory budget]). Invariant: `peak_after <= peak_before + allowance`.
    A graph without FSDP collectives is left as it is (and not walked)."""
    gathers, reductions = _prefetchable_gathers(graph, groups), _fsdp_reductions(graph, groups)
    gathered, reduced = [g.size for g in gathers], [r.size for r in reductions]
    if not gathered and not reduced:
        return ReorderResult(moved=0, peak_before=0, peak_after=0, allowance=0, budgets=(0, 0))
    if config.max_in_flight_bytes is not None:
        gather_budget = reduction_budget = allowance = config.max_in_flight_bytes
    else:
        gather_budget, reduction_budget = config.prefetch_depth * max(gathered, default=0), max(reduced, default=0)
        allowance = gather_budget + reduction_budget
    if config.max_peak_growth_bytes is not None:
        allowance = config.max_peak_growth_bytes
    order = list(graph.nodes)
    skip = not_alike(graph)  # moves keep the nodes: one set of facts serves every walk below
    lifetimes = Lifetimes(graph, skip=skip)
    before = lifetimes.peak()
    for fraction in _RETRY_FRACTIONS:
        budgets = (int(gather_budget * fraction), int(reduction_budget * fraction))
        # the baseline: nothing prefetched, gathers waited at first use, reductions at their launch
        _place_gathers(gathers, config=config, budget=0)
        _place_reductions(reductions, budget=0)
        _wait_reductions_at_launch(reductions)
        room = _Room(lifetimes, skip=skip, cap=before + allowance)
        # counted: the placements away from the baseline (gathers prefetched, waits delayed)
        moved = _place_gathers(gathers, config=config, budget=budgets[0], room=room)
        moved += _place_reductions(reductions, budget=budgets[1], room=room)
        after = lifetimes.peak()
        if after <= before + allowance:
            ordered = sorted(gathers, key=lambda g: min(g.consumers))
            place_host_copies(graph, [[*g.chain, g.launch] for g in ordered], landing=_landing)
            return ReorderResult(
                moved=moved, peak_before=before, peak_after=after, allowance=allowance, budgets=budgets
            )
        _restore(order)
    return ReorderResult(moved=0, peak_before=before, peak_after=before, allowance=allowance, budgets=(0, 0))


def _restore(order: list[fx.Node]) -> None:
    """Put a graph's nodes back in `order` (the same nodes: moves neither add nor remove any). The
    first node, a placeholder, never moves, so chaining each node after the one before it suffices."""
    for previous, node in itertools.pairwise(order):
        if previous.next is not node:
            previous.append(node)


def reorder_all_gathers(
    graph: fx.Graph,
    *,
    config: ReorderConfig,
    groups: Collection[tuple[int, ...]] | None = None,
    budget: int | None = None,
) -> int:
    """Prefetch all-gathers (on `groups`, if given) and sink their waits to first use; returns how
    many launches moved earlier. `budget`: bytes of prefetched gathered buffers (default: the config's)."""
    gathers = _prefetchable_gathers(graph, groups)
    if budget is None:
        budget = config.max_in_flight_bytes or config.prefetch_depth * max((g.size for g in gathers), default=0)
    return _place_gathers(gathers, config=config, budget=budget)


def _place_gathers(gathers: list[_Movable], *, config: ReorderConfig, budget: int, room: _Room | None = None) -> int:
    """`reorder_all_gathers` on gathers found before; `room`: if given, a gather is prefetched only as
    far as the live bytes leave room for it."""
    gathers = sorted(gathers, key=lambda g: min(g.consumers))  # by first use
    for g in gathers:  # wait (and unpacking) right before the first use
        _move_before(min(g.consumers), [g.wait, *g.landing])
    moved, previous_anchor = 0, 0
    sizes = [g.size for g in gathers]
    for j, g in enumerate(gathers):
        depth = min(config.prefetch_depth, j)
        while depth > 0 and sum(sizes[j - depth + 1 : j + 1]) > budget:
            depth -= 1
        anchor_index = max(j - depth, previous_anchor)
        if room is not None:  # the gathered buffer and its copy-in live from the anchor on
            extra = room.held([*g.chain, g.launch])
            while anchor_index < j and not room.take(gathers[anchor_index].wait, g.launch, extra):
                anchor_index += 1
        previous_anchor = anchor_index
        anchor = gathers[anchor_index].wait
        if anchor_index == j or g.launch < anchor:
            continue  # no prefetch asked for, or already launched early enough: never delay a launch
        _move_before(anchor, [n for n in g.chain if n > anchor] + [g.launch])
        moved += 1
    return moved


def reorder_reductions(
    graph: fx.Graph,
    *,
    config: ReorderConfig,
    groups: Collection[tuple[int, ...]] | None = None,
    budget: int | None = None,
) -> int:
    """Launch each gradient reduction (on `groups`, if given) right after its inputs exist, wait as
    late as the budget allows; returns how many waits moved. `budget`: bytes of the inputs of the
    reductions in flight (default: the config's, or the largest reduction's input)."""
    reductions = _fsdp_reductions(graph, groups)
    if budget is None:
        budget = config.max_in_flight_bytes or max((r.size for r in reductions), default=0)
    return _place_reductions(reductions, budget=budget)


def _place_reductions(reductions: list[_Movable], *, budget: int, room: _Room | None = None) -> int:
    """`reorder_reductions` on reductions found before; `room`: if given, a wait is delayed only as
    far as the live bytes leave room for the reduction's input."""
    for r in reductions:  # as soon as possible: each chain node right after its latest input
        for node in sorted(r.chain):
            inputs = node.all_input_nodes
            if inputs and (latest := max(inputs)).next is not node:
                latest.append(node)
    reductions = sorted(reductions, key=lambda r: r.launch)
    launch_of = [_first_buffer(r) for r in reductions]
    sizes = [r.size for r in reductions]
    moved = 0
    for i, r in enumerate(reductions):
        landing, consumers = r.landing, r.consumers
        limits = [min(consumers)] if consumers else []
        in_flight = sizes[i]
        for m in range(i + 1, len(reductions)):
            in_flight += sizes[m]
            if in_flight > budget:
                # unless m reads r's result (HYBRID): then it launches after r's wait anyway
                if min(reductions[m].chain) not in landing:
                    limits.append(launch_of[m])
                break
        if not limits:
            continue
        anchor = min(limits)
        if room is not None and anchor > r.wait:
            anchor = _delay_within(room, r.wait, anchor, sizes[i], stops=launch_of[i + 1 :])
        if anchor > r.wait and _after_landing(r.wait, landing) is not anchor:
            _move_before(anchor, [r.wait, *landing])
            moved += 1
        elif anchor < r.wait:
            # launching early (above) put a later reduction's launch before this wait, past the
            # budget: wait first -- but never before this reduction's own launch
            target = anchor if anchor > r.launch else r.launch.next
            if target < r.wait:
                _move_before(target, [r.wait, *landing])
                moved += 1
    return moved


def _first_buffer(reduction: _Movable) -> fx.Node:
    """Where a reduction's launch starts to hold memory: the first node of its chain that allocates
    (the gradient's cast or the bucket's copy-in), else the launch.

    [Note: a reduction starts at its first buffer]
    A reduction's chain also holds views of the gradients (transposes, reshapes), each placed right
    after its gradient's producer, which can be early in the block's backward. They hold no memory,
    so a wait delayed past them keeps nothing more alive than one stopped before them: limiting the
    delay at the chain's first node made the placement depend on where the gradients' views happen
    to sit (one model's backward traced with the CPU's attention kernel and with the CUDA one, equal
    in memory, got different orders: the CUDA one's extra views sit earlier)."""
    return min((node for node in reduction.chain if allocates(node)), default=reduction.launch)


def _wait_reductions_at_launch(reductions: list[_Movable]) -> None:
    """Each gradient reduction's wait (with its landing) right after its launch: none overlaps anything."""
    for r in reductions:
        if r.launch.next is not r.wait:
            _move_before(r.launch.next, [r.wait, *r.landing])


def _delay_within(room: _Room, wait: fx.Node, limit: fx.Node, held: int, *, stops: list[fx.Node]) -> fx.Node:
    """How far (up to `limit`) a reduction's wait may move while its input (`held` bytes) stays
    live: step by step past the later reductions' launches (`stops`) while the room takes it;
    `wait` itself if not even the first step fits."""
    reached = wait
    for stop in sorted({s for s in stops if wait < s < limit} | {limit}):
        if not room.take(reached, stop, held):
            break
        reached = stop
    return reached
