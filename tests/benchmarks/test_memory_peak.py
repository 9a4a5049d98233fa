"""benchmarks/tools/memory_peak.py: the allocations live at an allocator trace's peak, grouped by source."""

import gzip
import pickle

import benchmarks.tools.memory_peak as memory_peak


def load():
    return memory_peak


def event(action, addr, size, filename="x.py", line=1):
    return {"action": action, "addr": addr, "size": size, "frames": [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 9, "name": "f"},
        {"filename": f"/repo/slidedp/{filename}", "line": line, "name": "g"}]}


def test_peak_and_what_is_live_there(tmp_path, capsys):
    mp = load()
    trace = [event("alloc", 1, 100, "a.py"), event("alloc", 2, 50, "b.py"), event("free_requested", 1, 100),
             event("free_completed", 1, 100), event("alloc", 3, 120, "a.py", 7), event("alloc", 4, 10, "b.py"),
             event("free_completed", 3, 120), event("alloc", 5, 60, "c.py")]
    # totals: 100, 150, 50, 170, 180 (peak: 2, 3, 4 live), 60, 120
    out = mp.summary({"device_traces": [[], trace]})
    assert out["device"] == 1 and out["peak_bytes"] == 180 and out["event"] == 5
    assert out["live"] == [{"where": "slidedp/a.py:7 (g)", "bytes": 120, "allocations": 1},
                           {"where": "slidedp/b.py:1 (g)", "bytes": 60, "allocations": 2}]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [trace]}))
    assert mp.main([str(path), "--allocated-peak", "200"]) == 0
    assert '"not_in_trace_bytes": 20' in capsys.readouterr().out


def test_each_stream_reserves_for_itself():
    mp = load()

    def seg(action, size, stream):
        return {"action": action, "addr": 0, "size": size, "stream": stream, "frames": []}

    def mem(action, addr, size, stream):
        return dict(event(action, addr, size), stream=stream)

    trace = [seg("segment_map", 100, 1), mem("alloc", 1, 80, 1), seg("segment_alloc", 60, 2),
             mem("alloc", 2, 60, 2), mem("free_completed", 1, 80, 1), seg("segment_unmap", 100, 1),
             mem("free_completed", 2, 60, 2), seg("segment_map", 40, 1), mem("alloc", 3, 40, 1)]
    # total reserve: 100, 160 (peak), 60, 100
    out = mp.by_stream(trace)
    assert out["reserved_peak_bytes"] == 160 and out["sum_of_stream_reserved_peaks_bytes"] == 160
    assert out["streams"] == [{"stream": 1, "peak_allocated_bytes": 80, "peak_reserved_bytes": 100},
                              {"stream": 2, "peak_allocated_bytes": 60, "peak_reserved_bytes": 60}]
    # stream 2 grows only once stream 1 gave its pages back: the peaks, at different moments, add up to
    # more than the total ever reached
    apart = [seg("segment_map", 100, 1), seg("segment_unmap", 100, 1), seg("segment_map", 70, 2)]
    assert mp.by_stream(apart)["reserved_peak_bytes"] == 100
    assert mp.by_stream(apart)["sum_of_stream_reserved_peaks_bytes"] == 170
    segments = [{"device": 0, "stream": 1, "total_size": 64, "allocated_size": 16},
                {"device": 0, "stream": 1, "total_size": 32, "allocated_size": 0},
                {"device": 0, "stream": 2, "total_size": 128, "allocated_size": 128},
                {"device": 1, "stream": 1, "total_size": 999, "allocated_size": 0}]
    assert mp.segments_by_stream(segments, 0) == [
        {"stream": 2, "reserved_bytes": 128, "allocated_bytes": 128, "segments": 1},
        {"stream": 1, "reserved_bytes": 96, "allocated_bytes": 16, "segments": 2}]
    whole = mp.summary({"device_traces": [trace], "segments": segments[:3]})
    assert whole["reserved_peak_bytes"] == 160 and [s["stream"] for s in whole["segments_at_end"]] == [2, 1]


def test_a_block_freed_with_work_queued_on_another_stream_stays_held(tmp_path, capsys):
    """A freed tensor recorded on another stream (`record_stream`) is taken back by the allocator only
    once that stream's queued work ran: held (peak_bytes) beyond the allocated peak, and named
    (pending_at_peak); the tool reads a gzipped snapshot too."""
    mp = load()
    trace = [event("alloc", 1, 100, "w.py"), event("free_requested", 1, 100), event("alloc", 2, 100, "w.py"),
             event("free_requested", 2, 100), event("alloc", 3, 100, "w.py"), event("free_completed", 1, 100),
             event("free_completed", 2, 100), event("free_requested", 3, 100), event("free_completed", 3, 100),
             event("alloc", 4, 30, "x.py")]
    out = mp.summary({"device_traces": [trace]})
    assert out["peak_bytes"] == 300 and out["event"] == 4  # 1 and 2 still held when 3 is made
    assert out["allocated_peak_in_trace_bytes"] == 100
    assert out["pending_at_peak"] == [{"where": "slidedp/w.py:1 (g)", "bytes": 200, "allocations": 2}]
    path = tmp_path / "s.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump({"device_traces": [trace]}, f)
    assert mp.main([str(path), "--allocated-peak", "150"]) == 0
    assert '"not_in_trace_bytes": 50' in capsys.readouterr().out  # against the allocated peak, not the held one
