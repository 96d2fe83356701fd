"""Live bytes along a graph's node order: the one liveness walk of the pass and of `simplefsdp inspect`.

[Note: what the walk counts]
Each node's output is allocated when the node runs and freed after its last use, as inductor's
generated code frees buffers: graph outputs live to the end, inputs (placeholders) from the start to
their last use. Views (a reshape of a contiguous tensor among them), `getitem`, `wait_tensor` and
in-place collectives (`..._out`, `all_reduce_`) alias their buffer's storage instead of allocating. A collective's
input stays alive until the collective's wait, not just until its launch: the communication reads
it in the background. Live bytes are split into gathered parameters / communication buffers
(outputs of all-gathers, of the bucket copy ops, and values derived only from gathered weights),
reduced gradients (outputs of reduce-scatters / all-reduces) and activations (everything else).

The communication library's own staging buffers are counted only when the caller says how large
they are (`graph_peak(staging=...)`, from a calibrated device profile: bytes per byte of a
collective's full buffer, held from its launch to its wait, as gathered / comm buffers).

Ignored: allocator fragmentation and caching, workspaces of libraries (cuBLAS, NCCL), and fusion
(inductor may fuse away intermediates this walk counts: for a graph's transients the walk is an
upper bound).

Invariant: the result depends only on the graph's order and its nodes' traced metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping

import torch
from torch import fx

from simplefsdp._compat import tree_leaves
from simplefsdp.passes.collectives import (
    collective_kind,
    derives_from_all_gather,
    is_all_gather,
    is_bucket_copy,
    is_data_movement,
    is_in_place,
    is_reduce_scatter,
    is_view_of_input,
    is_wait,
    parse_collective,
)

__all__ = [
    "ACTIVATIONS",
    "COMM_BUFFERS",
    "REDUCED_GRADIENTS",
    "GraphPeak",
    "Lifetimes",
    "allocates",
    "graph_peak",
    "nbytes",
    "not_alike",
    "peak_bytes",
    "sized_by_this_rank",
]

ACTIVATIONS = "activations"
COMM_BUFFERS = "gathered / comm buffers"
REDUCED_GRADIENTS = "reduced gradients"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPeak:
    """Liveness result for one graph: bytes at its peak, by kind, and the most ever held by comm buffers."""

    peak_bytes: int
    at_peak: dict[str, int]  # ACTIVATIONS, COMM_BUFFERS, REDUCED_GRADIENTS
    max_comm_bytes: int
    end_bytes: int  # live at the end (a forward: what it saves for backward and returns)


def nbytes(node: fx.Node) -> int:
    """Bytes of the tensors `node` produces, from its traced metadata."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):  # most nodes: no tree walk
        return val.numel() * val.dtype.itemsize
    return sum(t.numel() * t.dtype.itemsize for t in tree_leaves(val) if isinstance(t, torch.Tensor))


def _alias_of(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node`'s output shares, or None if it allocates its own."""
    if node.op != "call_function":
        return None
    if is_in_place(node):  # an in-place collective: on its `out=` buffer, or on its input
        out = node.kwargs.get("out")
        return out if isinstance(out, fx.Node) else node.args[0]
    if is_wait(node) or is_view_of_input(node):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    return None


def _kind(root: fx.Node) -> str:
    kind = collective_kind(root)
    if kind in ("reduce_scatter", "all_reduce"):
        return REDUCED_GRADIENTS
    if is_all_gather(root) or is_bucket_copy(root) or derives_from_all_gather(root):
        return COMM_BUFFERS
    return ACTIVATIONS


class Lifetimes:
    """The walk of [Note: what the walk counts] over one graph, split in two: what does not depend on
    the nodes' order (aliases, sizes, kinds, which nodes end a collective's read, staging) is computed
    once, here; `peak()` / `along()` walk the graph's current order.

    Invariant: valid while the graph's nodes only move (as a reorder moves them), staying topologically
    sorted; a node added or removed needs a new `Lifetimes`. `skip`: nodes not counted; `kind_of`: the
    kind each counted buffer is tallied under; `staging`: the communication library's bytes per byte
    of a collective's full buffer, per kind of collective.

    [Note: one walk's facts, many orders] A reorder walks the same nodes several times (before, the
    baseline, after each attempt); the order-free facts were most of each walk's time (a 64-block
    backward under cProfile: about 0.1 s of each 0.15 s walk), so they are gathered once per graph."""

    def __init__(
        self,
        graph: fx.Graph,
        *,
        skip: Collection[fx.Node] = frozenset(),
        kind_of: Callable[[fx.Node], str] = lambda node: ACTIVATIONS,
        staging: Mapping[str, float] | None = None,
    ) -> None:
        self.graph = graph
        root: dict[fx.Node, fx.Node] = {}
        for node in graph.nodes:  # topological order: an alias's source has its root already
            alias = _alias_of(node)
            root[node] = root.get(alias, alias) if alias is not None else node
        # per node: the nodes whose positions end its inputs' reads (a collective reads until its
        # wait), and the roots of those inputs
        self._reads: list[tuple[fx.Node, tuple[fx.Node, ...], tuple[fx.Node, ...]]] = []
        for node in graph.nodes:
            sources = tuple({root[source]: None for source in node.all_input_nodes})
            if not sources:
                continue
            waits = tuple(u for u in node.users if is_wait(u)) if collective_kind(node) is not None else ()
            self._reads.append((node, waits, sources))
        outputs = graph.find_nodes(op="output")
        self._returned = {root[value] for value in outputs[0].all_input_nodes} if outputs else set()
        counted = [n for n in graph.nodes if root[n] is n and n.op != "output" and n not in skip]
        self._kind = {node: kind_of(node) for node in counted}
        self._size = {node: nbytes(node) for node in counted}
        self._staged: list[tuple[fx.Node, tuple[fx.Node, ...], int]] = []  # (launch, its waits, bytes)
        if staging and any(factor > 0 for factor in staging.values()):
            for node in graph.nodes:
                collective = parse_collective(node)
                factor = staging.get(collective.kind, 0.0) if collective is not None else 0.0
                if factor > 0:
                    waits = tuple(u for u in node.users if is_wait(u))
                    self._staged.append((node, waits, int(factor * collective.full_nbytes)))

    def peak(self) -> int:
        """Peak live bytes in the graph's current order."""
        return self.walk()[0]

    def along(self) -> dict[fx.Node, int]:
        """The live bytes while each node runs, in the current order (its outputs allocated,
        nothing it frees freed yet)."""
        along: list[int] = []
        self.walk(along=along)
        return dict(zip(self.graph.nodes, along, strict=True))

    def walk(self, *, along: list[int] | None = None) -> tuple[int, dict[str, int], int, int]:
        """(peak, live bytes by kind at the peak, most comm bytes, live at the end) in the current
        order; `along`: if given, receives the live bytes at each node."""
        nodes = list(self.graph.nodes)
        position = {node: i for i, node in enumerate(nodes)}
        last_use: dict[fx.Node, int] = {}
        for node, waits, sources in self._reads:
            end = max(position[node], *(position[w] for w in waits)) if waits else position[node]
            for source in sources:
                if last_use.get(source, -1) < end:
                    last_use[source] = end
        for value in self._returned:  # returned values live to the end
            last_use[value] = len(nodes)
        frees: dict[int, list[fx.Node]] = {}
        for node in self._size:
            frees.setdefault(last_use.get(node, position[node]), []).append(node)
        taken: dict[int, int] = {}
        given: dict[int, int] = {}
        for launch, waits, size in self._staged:
            end = max(position[launch], *(position[w] for w in waits))
            taken[position[launch]] = taken.get(position[launch], 0) + size
            given[end] = given.get(end, 0) + size
        kinds, sizes = self._kind, self._size
        held: dict[str, int] = {}
        total, peak, at_peak, max_comm = 0, 0, {}, 0
        for i, node in enumerate(nodes):
            if node in kinds:
                held[kinds[node]] = held.get(kinds[node], 0) + sizes[node]
                total += sizes[node]
            if i in taken:
                held[COMM_BUFFERS] = held.get(COMM_BUFFERS, 0) + taken[i]
                total += taken[i]
            max_comm = max(max_comm, held.get(COMM_BUFFERS, 0))
            if along is not None:
                along.append(total)
            if total > peak:
                peak, at_peak = total, dict(held)
            for freed in frees.get(i, ()):
                held[kinds[freed]] -= sizes[freed]
                total -= sizes[freed]
            if i in given:
                held[COMM_BUFFERS] -= given[i]
                total -= given[i]
        return peak, at_peak, max_comm, total


def graph_peak(
    graph: fx.Graph, *, skip_inputs: Collection[str] = frozenset(), staging: Mapping[str, float] | None = None
) -> GraphPeak:
    """Walk `graph` as in [Note: what the walk counts]; placeholders named in `skip_inputs` (e.g. the
    parameter shards, counted elsewhere as persistent) are not counted; `staging`: per kind of
    collective, bytes the communication library stages per byte of its full buffer."""
    skip = {node for node in graph.find_nodes(op="placeholder") if node.name in skip_inputs}
    peak, at_peak, max_comm, end = Lifetimes(graph, skip=skip, kind_of=_kind, staging=staging).walk()
    return GraphPeak(peak_bytes=peak, at_peak=at_peak, max_comm_bytes=max_comm, end_bytes=end)


def peak_bytes(graph: fx.Graph) -> int:
    """Peak live bytes of what every rank holds alike: the walk without the nodes `not_alike(graph)`.
    What the pass checks its budget with: a decision on these bytes is the same on every rank, where
    one on this rank's own sizes could differ near a tie (a hang). To walk one graph's nodes in
    several orders, build `Lifetimes(graph, skip=not_alike(graph))` once instead."""
    return Lifetimes(graph, skip=not_alike(graph)).peak()


def allocates(node: fx.Node) -> bool:
    """Whether the walk gives `node` a buffer of its own (views, waits and in-place collectives alias one)."""
    return node.op != "output" and _alias_of(node) is None


def not_alike(graph: fx.Graph) -> set[fx.Node]:
    """The nodes `peak_bytes` does not count: the nodes `sized_by_this_rank`, except the bucket copy
    ops', whose buffers are padded to the same size on every rank, and the inputs those nodes,
    the bucket copies or collectives read -- parameter shards, held by the model whatever the graph
    does.

    [Note: the backward's inputs count] The other inputs do count, from the graph's start to their
    last use: in a backward they are the activations the forward saved, which inductor's code frees
    as the backward consumes them, the same size on every rank. Left out, a backward's live bytes
    seem to start near zero and grow with the reduced gradients, when the saved activations make its
    start as high as its end (the scoreboard's 8-block model: 17-19 MiB all along), and the pass
    would see room to overlap where there is none."""
    own = {node for node in sized_by_this_rank(graph) if not is_bucket_copy(node)}
    read_by_own = {
        source
        for source in graph.find_nodes(op="placeholder")
        if any(user in own or is_bucket_copy(user) or collective_kind(user) is not None for user in source.users)
    }
    return own | read_by_own


def sized_by_this_rank(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose tensors may have rank-dependent sizes (a smaller shard of an unevenly sharded
    parameter): data movement from graph inputs -- a shard's casts, pads and bucket copy-in on its
    way to an all-gather -- and everything downstream of a reduce-scatter's wait (this rank's
    gradient shard). Every other tensor -- gathered parameters, activations, full gradients -- has
    the same size on every rank."""
    prep, scattered = set(), set()
    for node in graph.nodes:  # graph order: a node's inputs come before it
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if inputs and all(i.op == "placeholder" or i in prep for i in inputs) and is_data_movement(node):
            prep.add(node)
        if any(i in scattered or (is_wait(i) and is_reduce_scatter(i.args[0])) for i in inputs):
            scattered.add(node)
    return prep | scattered
