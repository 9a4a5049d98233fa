"""Lanes, op kinds and track assignment shared by the Chrome trace and the HTML report.

Perfetto (and the HTML swimlanes, for legibility) need the slices of one track to be either
disjoint or nested. A plan's lane may hold partially overlapping operations (two chunk copies in
flight at once on one copy engine, say), so `assign_tracks` spreads each lane over sub-tracks,
first fit, in a fixed order: the same events always land on the same sub-tracks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

# Times are placed on a grid of 1/8 µs: such values are exact binary fractions, so `ts + dur` is
# exact in every trace reader (Perfetto truncates `ts * 1000` to integer nanoseconds).
TICKS_PER_US = 8

LANES: tuple[str, ...] = ("compute", "h2d", "d2h", "collective", "cpu_update")
LANE_TITLES: dict[str, str] = {
    "compute": "compute", "h2d": "H2D", "d2h": "D2H", "collective": "collective", "cpu_update": "CPU update",
}
# What an operation is, for colouring: one of these.
OP_KINDS: tuple[str, ...] = ("h2d", "fwd", "recompute", "bwd", "d2h", "update", "collective")
_KIND_BY_LANE = {"h2d": "h2d", "d2h": "d2h", "cpu_update": "update", "collective": "collective"}
_COMPUTE_WORDS = {"fwd": "fwd", "forward": "fwd", "recompute": "recompute", "bwd": "bwd", "backward": "bwd"}


def lane_order(lane: str) -> int:
    """Position of a lane in the display order; lanes this module does not know come last."""
    return LANES.index(lane) if lane in LANES else len(LANES)


def lane_title(lane: str) -> str:
    return LANE_TITLES.get(lane, lane)


def op_kind(lane: str, name: str) -> str:
    """The colour class of an operation: the lane for copies, updates and collectives; the first
    word of the name ("fwd L3", "recompute L3", "bwd L3") on the compute lane."""
    if lane in _KIND_BY_LANE:
        return _KIND_BY_LANE[lane]
    word = name.split(maxsplit=1)[0].lower() if name.strip() else ""
    return _COMPUTE_WORDS.get(word, "fwd")


def assign_tracks(intervals: Sequence[tuple[int, int]]) -> list[int]:
    """Sub-track index per (start, end) interval so that intervals on one sub-track nest or are disjoint.

    Integer (or otherwise exact) times: touching intervals (a.end == b.start) count as disjoint.
    Intervals are visited by start, longer first on ties, then input position; each goes to the
    first sub-track whose innermost open interval still contains it entirely. Each sub-track keeps
    a stack of open intervals whose ends never increase upward, so the top is the one to nest in.
    """
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1], i))
    stacks: list[list[int]] = []  # per sub-track: ends of the open, nested intervals
    track = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        if end < start:
            raise ValueError(f"interval ends before it starts: {start} > {end}")
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                track[i] = k
                break
        else:
            stacks.append([end])
            track[i] = len(stacks) - 1
    return track



def to_ticks(t_s: float) -> int:
    """Seconds to the 1/8 µs grid. Rounding is monotone, so order, touching and nesting survive it."""
    return round(t_s * 1e6 * TICKS_PER_US)


def sub_tracks(timeline: Sequence) -> tuple[list[int], dict[tuple[int, str], int]]:
    """Sub-track of each TimelineEvent within its (rank, lane), on the tick grid, and the number of
    sub-tracks per (rank, lane) that has events."""
    by_track: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, event in enumerate(timeline):
        if event.end_s < event.start_s:
            raise ValueError(f"timeline event {event.name!r} on rank {event.rank} ends before it starts")
        by_track[(event.rank, event.lane)].append(i)
    sub = [0] * len(timeline)
    depth: dict[tuple[int, str], int] = {}
    for key, indices in by_track.items():
        ks = assign_tracks([(to_ticks(timeline[i].start_s), to_ticks(timeline[i].end_s)) for i in indices])
        for i, k in zip(indices, ks):
            sub[i] = k
        depth[key] = max(ks) + 1
    return sub, depth
