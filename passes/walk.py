"""Depth-first walks over an FX graph: the one traversal every pass and view builds on.

- `walk(starts, follow=...)`: each node reachable from `starts` once;
- `reaches(start, found=..., follow=...)`: whether such a walk meets a node `found` accepts;
- `upstream(node, through=...)`: the region of ops `through` accepts that feeds `node`, and the
  nodes where it stops (e.g. inside: the casts and copies between a collective and what it sends;
  boundary: the graph inputs or the compute that produced it).

Invariant: the result depends only on the graph's edges and the predicates, never on timing or
rank, so a decision built on a walk is the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from torch import fx

__all__ = ["Region", "reaches", "upstream", "walk"]

Follow = Callable[[fx.Node], Iterable[fx.Node]]


def walk(starts: Iterable[fx.Node], *, follow: Follow) -> Iterator[fx.Node]:
    """Each node reachable from `starts` (included), once, depth first; `follow(node)` names the nodes
    the walk goes on to from `node` (called once per node, after the node is yielded)."""
    stack, seen = list(starts), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(follow(node))


def reaches(start: fx.Node, *, found: Callable[[fx.Node], bool], follow: Follow) -> bool:
    """True once a walk from `start` meets a node `found` accepts (that node is not followed)."""
    return any(found(node) for node in walk([start], follow=follow))


@dataclasses.dataclass(frozen=True)
class Region:
    """What feeds a node through accepted ops: `inside` (the accepted ops), `boundary` (the first
    nodes not accepted on each path: where the values come from). Both in walk order."""

    inside: list[fx.Node]
    boundary: list[fx.Node]


def upstream(node: fx.Node, *, through: Callable[[fx.Node], bool]) -> Region:
    """The region feeding `node`'s inputs through ops `through` accepts (see `Region`)."""
    inside, boundary = [], []
    for current in walk(node.all_input_nodes, follow=lambda n: n.all_input_nodes if through(n) else ()):
        (inside if through(current) else boundary).append(current)
    return Region(inside, boundary)
