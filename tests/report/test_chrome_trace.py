"""Chrome / Perfetto trace: processes per rank, lane tracks, counters, never a partial overlap on a track."""

import json
import random
from collections import defaultdict
from fractions import Fraction

import pytest

from slidedp.report.chrome_trace import TICKS_PER_US, chrome_trace, to_chrome_trace
from slidedp.report.tracks import LANES, assign_tracks
from slidedp.scheduler.plan import TimelineEvent

LANE_NAMES = ["compute", "H2D", "D2H", "collective", "CPU update"]


def partial_overlaps(intervals):
    """Brute force: pairs that overlap with neither containing the other (touching is fine)."""
    bad = []
    for i, (s1, e1) in enumerate(intervals):
        for s2, e2 in intervals[i + 1:]:
            overlap = s1 < e2 and s2 < e1
            nested = (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)
            if overlap and not nested:
                bad.append(((s1, e1), (s2, e2)))
    return bad


def slices_by_track(trace):
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            # Exact arithmetic as every reader should see it, and as Perfetto does: trunc(ts * 1000) ns.
            start = Fraction(e["ts"])
            tracks[(e["pid"], e["tid"])].append((start, start + Fraction(e["dur"])))
            assert int(e["ts"] * 1000) == e["ts"] * 1000 and int(e["dur"] * 1000) == e["dur"] * 1000
    return tracks


def metadata(trace, name):
    return {(e["pid"], e["tid"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == name}


def test_trace_has_a_process_per_rank_lane_tracks_and_counters(make_plan, tmp_path):
    plan = make_plan(world_size=3)
    path = tmp_path / "trace.json"
    to_chrome_trace(plan, path)
    trace = json.loads(path.read_text())

    processes = metadata(trace, "process_name")
    assert {pid: args["name"] for (pid, _), args in processes.items()} == {
        0: "rank 0", 1: "rank 1", 2: "rank 2", 3: "host"}
    threads = metadata(trace, "thread_name")
    for rank in range(3):
        assert [threads[(rank, tid)]["name"] for tid in range(1, 6)] == LANE_NAMES  # stable tids 1..5

    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(plan.timeline)
    assert {e["pid"] for e in slices} == {0, 1, 2}
    assert {e["cat"] for e in slices} == {"h2d", "fwd", "recompute", "bwd", "d2h", "update", "collective"}
    for e in slices:
        assert threads[(e["pid"], e["tid"])]["name"].split(" (")[0] in LANE_NAMES
    fwd = next(e for e in slices if e["name"] == "fwd L1" and e["pid"] == 1)
    source = next(e for e in plan.timeline if e.name == "fwd L1" and e.rank == 1)
    assert fwd["ts"] == pytest.approx(source.start_s * 1e6, abs=1 / TICKS_PER_US)
    assert fwd["dur"] == pytest.approx((source.end_s - source.start_s) * 1e6, abs=2 / TICKS_PER_US)
    assert fwd["args"]["layer_id"] == 1

    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    device = [e for e in counters if e["name"] == "device memory"]
    pinned = [e for e in counters if e["name"] == "pinned host memory"]
    assert len(device) == 3 * len(plan.memory_timeline) and {e["pid"] for e in device} == {0, 1, 2}
    assert len(pinned) == len(plan.memory_timeline) and {e["pid"] for e in pinned} == {3}
    assert max(e["args"]["bytes"] for e in device) == plan.peak_device_bytes
    assert trace["otherData"]["bottleneck"] == plan.predicted["bottleneck"]
    assert not any(partial_overlaps(iv) for iv in slices_by_track(trace).values())


def test_partial_overlaps_go_to_sub_tracks_nesting_and_touching_stay(make_plan):
    events = (
        TimelineEvent(0, "h2d", "a", 1, 0, 0.000, 0.002),
        TimelineEvent(0, "h2d", "b", 1, 1, 0.001, 0.003),  # partially overlaps a
        TimelineEvent(0, "h2d", "c", 2, 0, 0.003, 0.004),  # touches b: same track as a
        TimelineEvent(0, "compute", "fwd L1", 1, 0, 0.000, 0.004),
        TimelineEvent(0, "compute", "fwd L1 attn", 1, 0, 0.001, 0.002),  # nested
    )
    plan = make_plan(world_size=1).replace(timeline=events, memory_timeline=())
    trace = chrome_trace(plan)
    tid = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tid["a"] == tid["c"] == 2 and tid["b"] != 2
    assert tid["fwd L1"] == tid["fwd L1 attn"] == 1
    names = metadata(trace, "thread_name")
    assert names[(0, tid["b"])]["name"] == "H2D (2)"
    sort = metadata(trace, "thread_sort_index")
    assert sort[(0, 2)]["sort_index"] < sort[(0, tid["b"])]["sort_index"] < sort[(0, 3)]["sort_index"]


def random_timeline(rng: random.Random, world_size: int, n: int) -> tuple[TimelineEvent, ...]:
    """Random events with ties, touching ends, zero durations and inexact float times."""
    grid = [k * 1e-4 for k in range(12)]
    events = []
    for i in range(n):
        start = rng.choice(grid) if rng.random() < 0.6 else rng.uniform(0, 1.2e-3)
        end = start + (rng.choice([0.0, 1e-4, 2e-4, 5e-4]) if rng.random() < 0.6 else rng.uniform(0, 6e-4))
        if rng.random() < 0.3:
            end = rng.choice([g for g in grid if g >= start] or [start])
        lane = rng.choice(LANES + ("custom",)) if rng.random() < 0.95 else "custom"
        events.append(TimelineEvent(rng.randrange(world_size), lane, f"op{i}", i % 7, i % 3, start, end))
    return tuple(events)


@pytest.mark.parametrize("seed", range(40))
def test_no_track_ever_has_a_partial_overlap(make_plan, seed):
    rng = random.Random(seed)
    world_size = rng.randint(1, 4)
    events = random_timeline(rng, world_size, rng.randint(0, 80))
    plan = make_plan(world_size=world_size, blocks=2, chunks=1, timeline=False).replace(timeline=events)
    trace = json.loads(json.dumps(chrome_trace(plan)))
    for track, intervals in slices_by_track(trace).items():
        assert partial_overlaps(intervals) == [], track
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in slices) == sorted(e.name for e in events)
    threads = metadata(trace, "thread_name")
    lane_of = {e.name: e for e in events}
    for e in slices:
        source = lane_of[e["name"]]
        assert e["pid"] == source.rank
        title = threads[(e["pid"], e["tid"])]["name"].split(" (")[0]
        assert title == {"h2d": "H2D", "d2h": "D2H", "cpu_update": "CPU update"}.get(source.lane, source.lane)
    # Deterministic: the same input gives the same file; any input order gives the same slices.
    assert chrome_trace(plan) == chrome_trace(plan)
    shuffled = list(events)
    rng.shuffle(shuffled)
    again = chrome_trace(plan.replace(timeline=tuple(shuffled)))

    def placed(t):
        return sorted((e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in t["traceEvents"] if e["ph"] == "X")

    assert placed(again) == placed(trace)


def test_assign_tracks_nests_or_separates():
    rng = random.Random(7)
    for _ in range(200):
        intervals = []
        for _ in range(rng.randint(0, 30)):
            s = rng.randint(0, 20)
            intervals.append((s, s + rng.randint(0, 8)))
        tracks = assign_tracks(intervals)
        for k in set(tracks):
            assert partial_overlaps([iv for iv, t in zip(intervals, tracks) if t == k]) == []
    assert assign_tracks([(0, 4), (1, 2), (2, 3), (3, 5)]) == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="ends before"):
        assign_tracks([(3, 1)])


def test_plan_without_timeline_says_so(make_plan):
    trace = chrome_trace(make_plan(world_size=2, timeline=False))
    assert not [e for e in trace["traceEvents"] if e["ph"] in ("X", "C")]
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(instants) == 1 and "no predicted timeline" in instants[0]["name"]
    assert "no predicted timeline" in trace["otherData"]["notes"]
    assert {args["name"] for args in metadata(trace, "process_name").values()} == {"rank 0", "rank 1", "host"}


def test_a_saved_and_loaded_plan_gives_the_same_trace(make_plan, tmp_path):
    from slidedp.scheduler.plan import Plan

    plan = make_plan(world_size=2)
    plan.save(tmp_path / "plan.json")
    assert chrome_trace(Plan.load(tmp_path / "plan.json")) == chrome_trace(plan)
