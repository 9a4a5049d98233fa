"""A plan's predicted timeline as Chrome trace JSON, for Perfetto (ui.perfetto.dev) or chrome://tracing.

Layout: one process per rank ("rank r"), one thread per lane (compute, H2D, D2H, collective,
CPU update) with fixed tids and names given by metadata events, complete events ("X") for the
operations, counter events ("C") for device memory per rank and, in a separate "host" process,
pinned host memory for all ranks.

Times are written in microseconds on a grid of 1/8 µs (`tracks.TICKS_PER_US`): such values are
exact binary fractions, so `ts + dur` is exact in every reader, including Perfetto's JSON importer,
which truncates `ts * 1000` to integer nanoseconds. Slices that touch or nest in the plan still
touch or nest in the file; slices that partially overlap go to extra sub-tracks of their lane
(`tracks.assign_tracks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp.report.tracks import TICKS_PER_US, LANES, lane_order, lane_title, op_kind, sub_tracks, to_ticks

if TYPE_CHECKING:
    from slidedp.scheduler.plan import Plan

NO_TIMELINE = ("this plan has no predicted timeline (solver {solver}): the trace only names the ranks and "
               "lanes; plans from the scheduler record a timeline")


def _us(ticks: int) -> float | int:
    """Ticks to microseconds, as an int where whole (shorter JSON), else an exact binary fraction."""
    return ticks // TICKS_PER_US if ticks % TICKS_PER_US == 0 else ticks / TICKS_PER_US


def _ranks(plan: "Plan") -> list[int]:
    return sorted(set(range(plan.workload.world_size)) | {e.rank for e in plan.timeline}) or [0]


def _lanes(plan: "Plan") -> list[str]:
    """The five known lanes always (stable tids), then any other lane the plan uses, by name."""
    extra = sorted({e.lane for e in plan.timeline} - set(LANES))
    return list(LANES) + extra


def chrome_trace(plan: "Plan") -> dict:
    """The trace as a JSON-ready dict (Chrome "JSON object format")."""
    ranks = _ranks(plan)
    lanes = _lanes(plan)
    host_pid = ranks[-1] + 1

    sub_track, depth = sub_tracks(plan.timeline)
    ticks = [(to_ticks(e.start_s), to_ticks(e.end_s)) for e in plan.timeline]
    max_depth = max(depth.values(), default=1)

    def tid(lane: str, k: int) -> int:
        """Lane tids 1..n for sub-track 0 (stable whatever the plan), then n+1.. for sub-track 1, ..."""
        return lanes.index(lane) + 1 + len(lanes) * k

    events: list[dict] = []
    for rank in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for lane in lanes:
            for k in range(depth.get((rank, lane), 1)):
                title = lane_title(lane) if k == 0 else f"{lane_title(lane)} ({k + 1})"
                sort_index = lanes.index(lane) * max_depth + k
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid(lane, k),
                               "args": {"name": title}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid(lane, k),
                               "args": {"sort_index": sort_index}})
    events.append({"ph": "M", "name": "process_name", "pid": host_pid, "tid": 0, "args": {"name": "host"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": host_pid, "tid": 0,
                   "args": {"sort_index": host_pid}})

    slices = []
    for i, e in enumerate(plan.timeline):
        start, end = ticks[i]
        slices.append(((e.rank, lane_order(e.lane), e.lane, sub_track[i], start, -end, i), {
            "ph": "X", "name": e.name, "cat": op_kind(e.lane, e.name), "pid": e.rank,
            "tid": tid(e.lane, sub_track[i]), "ts": _us(start), "dur": _us(end - start),
            "args": {"layer_id": e.layer_id, "chunk": e.chunk, "start_s": e.start_s, "end_s": e.end_s},
        }))
    # Per track by start, enclosing slices first, so readers that stream the file see parents first.
    events.extend(event for _, event in sorted(slices, key=lambda item: item[0]))

    for point in sorted(plan.memory_timeline, key=lambda p: p.t_s):
        ts = _us(to_ticks(point.t_s))
        for rank in ranks:
            events.append({"ph": "C", "name": "device memory", "pid": rank, "tid": 0, "ts": ts,
                           "args": {"bytes": point.device_bytes}})
        events.append({"ph": "C", "name": "pinned host memory", "pid": host_pid, "tid": 0, "ts": ts,
                       "args": {"bytes": point.pinned_host_bytes}})

    notes = list(plan.notes)
    if not plan.timeline:
        message = NO_TIMELINE.format(solver=plan.solver.get("method", "?"))
        notes.insert(0, message)
        events.append({"ph": "i", "s": "g", "name": message, "pid": ranks[0], "tid": tid(lanes[0], 0), "ts": 0})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": f"slidedp {plan.slidedp_version}",
            "model_class": plan.model_class,
            "hardware": str(plan.hardware.get("name", "?")),
            "budget_bytes": str(plan.budget_bytes),
            "peak_device_bytes": str(plan.peak_device_bytes),
            "predicted_step_s": str(plan.predicted.get("step_s", "?")),
            "bottleneck": str(plan.predicted.get("bottleneck", "?")),
            "solver": ", ".join(f"{k}={v}" for k, v in sorted(plan.solver.items())),
            "notes": " | ".join(notes),
        },
    }


def to_chrome_trace(plan: "Plan", path: str | Path) -> None:
    """Write the plan's predicted timeline to `path` as Chrome trace JSON."""
    Path(path).write_text(json.dumps(chrome_trace(plan), separators=(",", ":")))
