"""A Program as a dependency graph: which op must end before which may start.

Nodes are op indices (attributes: stream, kind, layer_id). Edges: program order within each
stream (a stream runs its ops one after the other), and recorder -> waiter for each waited event.
A cycle in this graph is a deadlock on the GPU: every op on it waits, directly or through its
stream, for one later on it. `slidedp.backend.lowering.verify` refuses such programs.
"""

from __future__ import annotations

import networkx as nx

from slidedp.backend.lowering.program import Program


def event_recorders(program: Program) -> dict[int, list[int]]:
    """Event id -> indices of the ops that record it (a valid program records each event once)."""
    out: dict[int, list[int]] = {}
    for op in program.ops:
        if op.record is not None:
            out.setdefault(op.record, []).append(op.index)
    return out


def dependency_graph(program: Program) -> nx.DiGraph:
    """Stream order and event edges of `program`; a wait on an event no op records adds no edge
    (`unrecorded_waits` names those)."""
    graph = nx.DiGraph()
    last_on_stream: dict[str, int] = {}
    for op in program.ops:
        graph.add_node(op.index, stream=op.stream, kind=op.kind, layer_id=op.layer_id)
        if op.stream in last_on_stream:
            graph.add_edge(last_on_stream[op.stream], op.index, why="stream")
        last_on_stream[op.stream] = op.index
    recorders = event_recorders(program)
    for op in program.ops:
        for event in op.waits:
            for recorder in recorders.get(event, ()):
                graph.add_edge(recorder, op.index, why=f"event {event}")
    return graph


def unrecorded_waits(program: Program) -> list[tuple[int, int]]:
    """(op index, event) for each wait on an event that no op of `program` records."""
    recorders = event_recorders(program)
    return [(op.index, e) for op in program.ops for e in op.waits if e not in recorders]


def find_deadlock(graph: nx.DiGraph) -> list[tuple[int, int]]:
    """The edges of one cycle of `graph` (ops that wait for each other forever), or [] if none."""
    try:
        return [(u, v) for u, v, *_ in nx.find_cycle(graph)]
    except nx.NetworkXNoCycle:
        return []
