"""benchmarks/tools/memory_peak.py: the allocations live at an allocator trace's peak, grouped by source."""

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
