"""The module graph: the one place that orders modules along their edges.

Pure, no torch. Built on `graphlib.TopologicalSorter` (iterative, so a chain of thousands of
modules is fine). Validation (`validate.py`) and the schedule tables use this, so a cycle is named
the same way everywhere.
"""

from __future__ import annotations

import graphlib
import heapq
from typing import Iterable

from megatron_hetero.layout.spec import Edge, HeteroLayout


def _sorter(names: list[str], edges: Iterable[Edge]) -> graphlib.TopologicalSorter:
    ts: graphlib.TopologicalSorter = graphlib.TopologicalSorter()
    for n in names:
        ts.add(n)
    for e in edges:
        ts.add(e.dst, e.src)  # dst depends on src
    return ts


def _cycle_error(names: list[str], cycle: list[str]) -> ValueError:
    """The ValueError naming `cycle` (graphlib's form: first == last, in edge direction), rotated to
    start at the module declared first, so the message does not depend on graphlib's walk order."""
    ring = cycle[:-1]
    index = {n: i for i, n in enumerate(names)}
    start = min(range(len(ring)), key=lambda i: index.get(ring[i], len(names)))
    ring = ring[start:] + ring[:start]
    return ValueError(f"edges form a cycle: {' -> '.join(ring + [ring[0]])}; the module graph must be acyclic")


def order_modules(names: list[str], edges: Iterable[Edge]) -> list[str]:
    """`names` ordered so that every edge's src comes before its dst; among the modules whose
    producers are all placed, the one declared first comes next. Raises ValueError naming one
    cycle ("edges form a cycle: a -> b -> a; ...") when there is none such order.

    An edge naming a module not in `names` is a ValueError too."""
    names, edges = list(names), list(edges)
    known = set(names)
    for e in edges:
        for end in (e.src, e.dst):
            if end not in known:
                raise ValueError(f"edge {e}: unknown module {end!r}; modules are {names}")
    ts = _sorter(names, edges)
    try:
        ts.prepare()
    except graphlib.CycleError as exc:
        raise _cycle_error(names, list(exc.args[1])) from None
    index = {n: i for i, n in enumerate(names)}
    heap: list[tuple[int, str]] = []
    order: list[str] = []
    while ts.is_active():
        for n in ts.get_ready():
            heapq.heappush(heap, (index[n], n))
        _, n = heapq.heappop(heap)
        order.append(n)
        ts.done(n)
    return order


def topological_order(layout: HeteroLayout) -> list[str]:
    """The layout's module names so that every producer comes before its consumers (declaration
    order breaks ties). Raises ValueError naming a cycle of the edges."""
    return order_modules(layout.names, layout.edges)
