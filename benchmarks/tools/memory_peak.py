"""What is allocated at a step's device-memory peak, from a CUDA caching-allocator snapshot.

`torch.cuda.memory._record_memory_history()` records every allocation and free with its Python
stack; `torch.cuda.memory._dump_snapshot(path)` writes them. This replays a device's trace, finds the
moment the allocated bytes peak, and groups what is live then by the first stack frame in slidedp
(else transformers, else torch):

    python benchmarks/tools/memory_peak.py snapshot.pickle --top 25

(`benchmarks/diagnose_step/run.py --memory-snapshot` records one for a step, gzipped; both are read.)
Allocations made before recording began are not in the trace; they are reported as the difference to
the allocator's own peak when that is given (`--allocated-peak`).

A block counts from its allocation until the allocator takes it back (`free_completed`): a tensor
freed while another stream still has work queued on it (`record_stream`) stays held, out of the
allocated bytes the allocator reports but in what it must reserve. `peak_bytes` is that held peak;
`allocated_peak_in_trace_bytes` counts each block only until its free was asked for
(`free_requested`), as `torch.cuda.max_memory_allocated` does; `pending_at_peak` lists, grouped as
`live`, what was freed but still held at the held peak.

The allocator caches memory per CUDA stream: a block freed on one stream is reused only by allocations
on that stream, and each stream's expandable segment grows on its own. So `streams` gives, per stream,
the peak of what it allocated and of what its segments reserved over the trace (segments mapped or
allocated less those unmapped or freed; their sum over streams, `sum_of_stream_reserved_peaks_bytes`,
against the peak of the total, `reserved_peak_bytes`, says how much the streams' peaks at different
moments add up), and what the snapshot's segments hold at its end.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pickle
import sys

PREFERRED = ("slidedp/", "transformers/", "torch/")


def where(frames: list[dict]) -> str:
    """The allocation's first frame in slidedp, else transformers, else torch, else the first."""
    for marker in PREFERRED:
        for f in frames:
            if marker in f.get("filename", ""):
                path = f["filename"].split(marker, 1)[1]
                return f"{marker}{path}:{f.get('line')} ({f.get('name')})"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "(no stack)"


def peak_of(trace: list[dict], free: str = "free_completed") -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the event reaching it, the allocations live then by address), a block
    counted until its `free` event ("free_completed": held; "free_requested": allocated, or held
    where a trace has no request)."""
    ends = {free, "free_completed"}
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] in ends and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    live = {}
    for e in trace[: at + 1]:  # replay again up to the peak: what is live there
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in ends:
            live.pop(e["addr"], None)
    return peak, at, live


def pending_at(trace: list[dict], at: int) -> dict[int, dict]:
    """The allocations whose free was asked for but not yet completed after event `at`, by address."""
    live, pending = {}, {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested" and e["addr"] in live:
            pending[e["addr"]] = live[e["addr"]]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            pending.pop(e["addr"], None)
    return pending


def grouped(allocations, top: int) -> list[dict]:
    """Allocations summed by where they were made (`where`), largest first."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for e in allocations:
        g = groups[where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"where": k, "bytes": b, "allocations": n} for k, (b, n) in rows]


SEGMENT_GROWS = ("segment_alloc", "segment_map")
SEGMENT_SHRINKS = ("segment_free", "segment_unmap")


def by_stream(trace: list[dict]) -> dict:
    """Per stream, the peaks of allocated and reserved bytes over `trace`, and the peak of the total
    reserve (see the module docstring)."""
    allocated: dict[int, int] = collections.defaultdict(int)
    reserved: dict[int, int] = collections.defaultdict(int)
    peaks: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    live: dict[int, tuple[int, int]] = {}
    total = total_peak = 0
    for e in trace:
        stream, action = e.get("stream", 0), e["action"]
        if action == "alloc":
            live[e["addr"]] = (stream, e["size"])
            allocated[stream] += e["size"]
        elif action == "free_completed" and e["addr"] in live:
            stream, size = live.pop(e["addr"])
            allocated[stream] -= size
        elif action in SEGMENT_GROWS:
            reserved[stream] += e["size"]
            total += e["size"]
            total_peak = max(total_peak, total)
        elif action in SEGMENT_SHRINKS:
            reserved[stream] -= e["size"]
            total -= e["size"]
        peak = peaks[stream]
        peak[0], peak[1] = max(peak[0], allocated[stream]), max(peak[1], reserved[stream])
    return {"reserved_peak_bytes": total_peak,
            "sum_of_stream_reserved_peaks_bytes": sum(r for _, r in peaks.values()),
            "streams": [{"stream": k, "peak_allocated_bytes": a, "peak_reserved_bytes": r}
                        for k, (a, r) in sorted(peaks.items(), key=lambda kv: -kv[1][1])]}


def segments_by_stream(segments: list[dict], device: int) -> list[dict]:
    """The snapshot's segments of `device` at its end, summed per stream: reserved and allocated bytes."""
    out: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for seg in segments:
        if seg.get("device", device) == device:
            row = out[seg.get("stream", 0)]
            row[0] += seg.get("total_size", 0)
            row[1] += seg.get("allocated_size", 0)
            row[2] += 1
    return [{"stream": k, "reserved_bytes": r, "allocated_bytes": a, "segments": n}
            for k, (r, a, n) in sorted(out.items(), key=lambda kv: -kv[1][0])]


def summary(snapshot: dict, top: int = 25, device: int | None = None) -> dict:
    traces = snapshot["device_traces"]
    device = max(range(len(traces)), key=lambda d: len(traces[d])) if device is None else device
    trace = traces[device]
    peak, at, live = peak_of(trace)
    return {"device": device, "peak_bytes": peak, "event": at, "events": len(trace),
            "allocated_peak_in_trace_bytes": peak_of(trace, "free_requested")[0],
            "live": grouped(live.values(), top),
            "pending_at_peak": grouped(pending_at(trace, at).values(), top),
            **by_stream(trace),
            "segments_at_end": segments_by_stream(snapshot.get("segments", []), device)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", type=int)
    p.add_argument("--allocated-peak", type=int, help="torch.cuda.max_memory_allocated() of the same run")
    args = p.parse_args(argv)
    opener = gzip.open if args.snapshot.endswith(".gz") else open
    with opener(args.snapshot, "rb") as f:
        out = summary(pickle.load(f), args.top, args.device)
    if args.allocated_peak is not None:
        out["not_in_trace_bytes"] = args.allocated_peak - out["allocated_peak_in_trace_bytes"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
