"""Where a slidedp step's time goes on the GPU: overlapped and isolated step times, a per-operation
breakdown with a device synchronisation after every program operation, host page faults and
context switches, and a torch.profiler table of one step.

    python benchmarks/diagnose_step/run.py --blocks 36 --tokens 16384 --out-dir /tmp/diag

Builds a benchmark shape (--shape, default the Qwen3-4B one; optionally with fewer blocks) exactly as
benchmarks/single_gpu_throughput/run.py does (benchmarks/common/model.py)
(seeded per-parameter init on the GPU, bf16 model on the host), compiles it with the solver's plan
(or a saved one, --plan; or every block forced to --policy), then per --tokens point:

* `overlapped`: steps as training runs them (the previous step's CPU update overlaps the pass);
* `isolated`: the previous update finished first, so `pass_s` is the forward + backward alone;
* `synced`: isolated, with `torch.cuda.synchronize()` after every program operation, timed per
  operation kind (the sum is the serial time of the pass; each kind's share says what is slow);
* `profile` (with --profile): torch.profiler tables and trace of --profile-steps overlapped steps (the
  first follows a flushed update; the later ones are steady: each overlaps the previous CPU round), and the
  plan's predicted trace of a step beside it (`predicted_<blocks>b_<tokens>.json`), and each CUDA
  stream's kernel time, busy time and span in that step (`gpu_lanes`);
* `memory_peak` (with --memory-snapshot): what is allocated at the first step's peak, by source line,
  and per CUDA stream the peaks of its allocations and of its reserve (with --memory-snapshot-steps N,
  through N overlapped steps after the first) (memory_peak.py; the long-context check: `--blocks 36 --tokens 262144 --seq 262144 --steps 0
  --no-synced --memory-snapshot --plan <its plan>`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.cli import grad_norm  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import slidedp  # noqa: E402
from slidedp.report import to_chrome_trace  # noqa: E402


def rusage() -> dict:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"minflt": r.ru_minflt, "majflt": r.ru_majflt, "nvcsw": r.ru_nvcsw, "nivcsw": r.ru_nivcsw,
            "utime": r.ru_utime, "stime": r.ru_stime}


def delta(a: dict, b: dict) -> dict:
    return {k: round(b[k] - a[k], 4) for k in a}


def timed_steps(engine, data, isolated: bool) -> list[dict]:
    out = []
    for ids in data:
        if isolated:
            engine.updates.flush()
        torch.cuda.synchronize()
        r0, t0 = rusage(), time.perf_counter()
        engine.step(ids)
        info = engine.last_step
        out.append({"step_s": time.perf_counter() - t0, "pass_s": info.pass_s, "wait_s": info.wait_s,
                    "previous_update_s": engine.updates.last_duration_s, "rusage": delta(r0, rusage())})
    engine.updates.flush()
    return out


def synced_step(engine, ids) -> dict:
    """One isolated step with a device synchronisation after every program operation."""
    ex = engine.executor
    per_kind: dict[str, float] = collections.defaultdict(float)
    per_op: list[tuple[str, float]] = []
    names = ["_op_prologue", "_op_h2d_weights", "_op_fwd", "_op_epilogue", "_op_bwd", "_op_prologue_bwd",
             "_op_d2h_grad"]
    originals = {n: getattr(ex, n) for n in names}

    def wrap(name, fn):
        def timed(op, st):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(op, st)
            t_host = time.perf_counter() - t0
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            key = name[4:] + ("/" + op.policy if getattr(op, "policy", None) else "")
            per_kind[key] += dt
            per_kind[key + " (host issue)"] += t_host
            per_op.append((op.text(), round(dt * 1e3, 3), round(t_host * 1e3, 3)))
        return timed

    for n, fn in originals.items():
        setattr(ex, n, wrap(n, fn))
    try:
        engine.updates.flush()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step(ids)
        step_s = time.perf_counter() - t0
        engine.updates.flush()
    finally:
        for n in names:
            delattr(ex, n)
    return {"step_s": step_s, "per_kind_s": {k: round(v, 4) for k, v in sorted(per_kind.items())},
            "slowest_ops_ms": sorted(per_op, key=lambda x: -x[1])[:25]}


KERNEL_KINDS = (("attention", ("flash", "fmha", "cudnn", "attention")),
                ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")),
                ("triton", ("triton",)), ("memcpy", ("memcpy", "memset")))


def gpu_lanes(trace: dict) -> dict:
    """Per CUDA stream of a torch.profiler trace: kernel time, busy time (union of intervals), span,
    and the kernel time by kind (matmul, attention, triton, memcpy, other) [ms]."""
    lanes: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            lanes[str(ev.get("args", {}).get("stream", ev.get("tid")))].append(
                (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev.get("name", "").lower()))
    out = {}
    for stream, evs in sorted(lanes.items()):
        evs.sort()
        busy, end, kinds = 0.0, float("-inf"), collections.defaultdict(float)
        for a, b, name in evs:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
            kind = next((k for k, keys in KERNEL_KINDS if any(key in name for key in keys)), "other")
            kinds[kind] += (b - a) / 1e3
        out[stream] = {"events": len(evs), "span_ms": (end - evs[0][0]) / 1e3, "busy_ms": busy / 1e3,
                       "by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items())}}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(bench.SHAPES), default="4b")
    p.add_argument("--blocks", type=int, help="blocks of the shape built (default: all of them)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--budget", default="40GiB")
    p.add_argument("--hardware", help="preset or profile (default: a saved plan's own, else h200-sxm)")
    p.add_argument("--max-grad-norm", type=grad_norm, default=1.0, help="clipping (default 1.0); 'none': no clipping")
    p.add_argument("--nonfinite", choices=["skip", "stop"], default="skip")
    p.add_argument("--policy", choices=["plan", "keep", "recompute"], default="plan")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=2, help="overlapped steps profiled (default 2)")
    p.add_argument("--no-synced", action="store_true")
    p.add_argument("--plan", help="a saved plan to run (its budget and workload); else solved here")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's, 4096)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="record the allocator's history from compile through the first step; write it and "
                        "what is live at its peak, and each stream's allocations and reserve (memory_peak.py)")
    p.add_argument("--memory-snapshot-steps", type=int, default=0,
                   help="with --memory-snapshot: overlapped steps recorded after the first, where the reserve "
                        "of a plan whose CPU runs ahead grows (default 0)")
    p.add_argument("--out-dir", required=True)
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = dict(bench.SHAPES[args.shape])
    args.blocks = args.blocks or shape["blocks"]
    shape["blocks"] = args.blocks
    tag = f"{args.shape}_{args.blocks}b"  # in the names of the files written
    if args.seq:
        shape["seq"] = args.seq
    bench.SHAPES["diag"] = shape
    t0 = time.perf_counter()
    model = bench.build_model("diag", dtype=torch.bfloat16, device="cpu", init_device=torch.device("cuda"), seed=0)
    torch.cuda.empty_cache()
    results = {**stamp, "shape": args.shape, "blocks": args.blocks, "build_s": time.perf_counter() - t0,
               "points": []}
    hardware = args.hardware or (None if args.plan else "h200-sxm")
    if hardware is not None and hardware.endswith(".json"):
        hardware = slidedp.Hardware.load(hardware)
    for tokens in args.tokens:
        rows = tokens // shape["seq"]
        kwargs = dict(batch_size=1, seq_len=shape["seq"], device="cuda", precision="bf16", micro_batches=rows,
                      hardware=hardware, max_grad_norm=args.max_grad_norm, nonfinite=args.nonfinite,
                      optimizer=slidedp.AdamW(lr=bench.LR, betas=bench.BETAS, eps=bench.EPS))
        plan = slidedp.Plan.load(args.plan) if args.plan else None
        budget = plan.budget_bytes if plan is not None else args.budget  # a saved plan's own budget
        if args.policy != "plan":
            plan = slidedp.plan(model, budget, **kwargs)
            plan = plan.replace(decisions=tuple(
                dataclasses.replace(d, activation=args.policy) if d.kind == "block" else d for d in plan.decisions))
        if args.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        t0 = time.perf_counter()
        engine = slidedp.compile(model, budget, plan=plan, **kwargs)
        point = {"tokens": tokens, "compile_s": time.perf_counter() - t0, "policy": args.policy,
                 "predicted_step_s": engine.plan.predicted_step_time_s, "predicted": engine.plan.predicted,
                 "activation": [d.activation for d in engine.plan.decisions], "window": engine.plan.window,
                 "update_threads": getattr(engine.updates, "num_threads", None)}
        print(engine.plan.summary(), flush=True)
        data = bench.batches(shape["vocab"], rows, shape["seq"], max(args.steps, args.profile_steps) + 1, seed=0)
        torch.cuda.reset_peak_memory_stats()
        point["warmup"] = timed_steps(engine, data[:1], isolated=False)
        if args.memory_snapshot and args.memory_snapshot_steps:
            point["recorded_steps"] = timed_steps(engine, data[1:1 + args.memory_snapshot_steps], isolated=False)
        if args.memory_snapshot:
            import pickle

            from benchmarks.tools import memory_peak

            path = out_dir / f"memory_{tag}_{tokens}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(path, "rb") as f:
                point["memory_peak"] = memory_peak.summary(pickle.load(f))
            point["memory_peak"]["allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
            point["memory_peak"]["reserved_peak_bytes_allocator"] = torch.cuda.max_memory_reserved()
            print(json.dumps(point["memory_peak"], indent=1), flush=True)
            os.system(f"gzip -f {path}")
        point["overlapped"] = timed_steps(engine, data[1:], isolated=False)
        point["isolated"] = timed_steps(engine, data[1:2], isolated=True)
        point["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        point["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved()
        print(json.dumps({k: v for k, v in point.items() if k not in ("predicted", "activation")}), flush=True)
        if not args.no_synced:
            point["synced"] = synced_step(engine, data[1])
            print(json.dumps(point["synced"], indent=1), flush=True)
        if args.profile:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                timed_steps(engine, data[1:1 + args.profile_steps], isolated=False)
                torch.cuda.synchronize()
            avg = prof.key_averages()
            for key in ("self_cuda_time_total", "cpu_time_total", "self_cpu_time_total"):
                table = avg.table(sort_by=key, row_limit=35, max_name_column_width=60)
                point["profile_" + key] = table
                print(table, flush=True)
            trace = out_dir / f"trace_{tag}_{tokens}.json"
            prof.export_chrome_trace(str(trace))
            point["gpu_lanes"] = gpu_lanes(json.loads(trace.read_text()))
            print(json.dumps(point["gpu_lanes"], indent=1), flush=True)
            os.system(f"gzip -f {trace}")
            # the plan's predicted timeline of the same step, to open beside it in Perfetto
            to_chrome_trace(engine.plan, out_dir / f"predicted_{tag}_{tokens}.json")
        engine.close()
        del engine
        torch.cuda.empty_cache()
        results["points"].append(point)
        (out_dir / f"diag_{tag}_{args.policy}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
