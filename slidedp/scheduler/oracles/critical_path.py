"""The critical path of a simulated step: the chain of pieces that sets its length.

The simulator (timeline.py) starts each piece at max(its lane is free, its dependencies have ended,
its release time). In the DAG of the pieces (edges: dependencies, and lane order; an edge u -> v
weighs u's duration, a piece that may end the step leads to a sink with its duration, the source
leads to each piece with its release time), no path is longer than the makespan, and the chain of
pieces each starting exactly when one before it ends is that long: the longest path's weight is the
makespan, to the tick. Shortening a piece off this path cannot shorten the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import networkx as nx

_SOURCE, _SINK = -1, -2


def longest_chain(lanes: Iterable[Sequence[int]], deps: Sequence[Sequence[int]], ticks: Sequence[int],
                  release: dict[int, int] | None = None,
                  ends_step: Callable[[int], bool] = lambda piece: True) -> tuple[tuple[int, ...], int]:
    """(pieces of the longest path in order, its weight in ticks) of pieces 0..len(ticks)-1 run on
    `lanes` (each in order) after their `deps`; only pieces with `ends_step` may end the step."""
    release = release or {}
    graph = nx.DiGraph()
    for piece, t in enumerate(ticks):
        graph.add_edge(_SOURCE, piece, weight=release.get(piece, 0))
        if ends_step(piece):
            graph.add_edge(piece, _SINK, weight=t)
    for lane in lanes:
        for a, b in zip(lane, lane[1:]):
            graph.add_edge(a, b, weight=ticks[a])
    for piece, before in enumerate(deps):
        for a in before:
            graph.add_edge(a, piece, weight=ticks[a])
    if not ticks:
        return (), 0
    # pieces that cannot lead to the end of the step (later CPU updates) end no path
    graph = graph.subgraph(nx.ancestors(graph, _SINK) | {_SINK})
    path = nx.dag_longest_path(graph, weight="weight")
    weight = sum(graph.edges[u, v]["weight"] for u, v in zip(path, path[1:]))
    return tuple(p for p in path if p >= 0), weight
