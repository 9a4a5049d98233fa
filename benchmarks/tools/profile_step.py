"""Profile slidedp steps on the GPU: step time per configuration and the top operations.

    python benchmarks/tools/profile_step.py --blocks 12 --tokens 8192 --out profile.json

Builds the Qwen3-4B shape with fewer blocks (same vocabulary and block size), runs warm-up steps,
then times steps with the fused loss on and off, and writes the torch.profiler tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
import time

import torch

import slidedp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.gpu_streamed_step.run import SHAPES, batches, qwen3  # noqa: E402


def timed_steps(engine, data, isolated: bool = False) -> list[dict]:
    """Step times; `isolated`: the previous step's CPU update is finished first (no overlap), so
    pass_s is the forward + backward alone."""
    out = []
    for ids in data:
        if isolated:
            engine.updates.flush()
        t0 = time.perf_counter()
        engine.step(ids)
        info = engine.last_step
        out.append({"step_s": time.perf_counter() - t0, "pass_s": info.pass_s, "wait_s": info.wait_s,
                    "previous_update_s": engine.updates.last_duration_s})
    engine.updates.flush()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--budget", default="40GiB")
    p.add_argument("--skip-unfused", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    h, i, _, heads, kv, hd, vocab = SHAPES["4b"]
    SHAPES["probe"] = (h, i, args.blocks, heads, kv, hd, vocab)
    model = qwen3("probe", dtype=torch.bfloat16)
    rows = args.tokens // args.seq
    engine = slidedp.compile(model, args.budget, batch_size=1, seq_len=args.seq, device="cuda", precision="bf16",
                             micro_batches=rows, hardware="h200-sxm", max_grad_norm=1.0)
    data = batches(vocab, rows, args.seq, 3)
    result = {"blocks": args.blocks, "tokens": args.tokens, "predicted": engine.plan.predicted,
              "activation": [d.activation for d in engine.plan.decisions], "window": engine.plan.window}
    result["warmup"] = timed_steps(engine, data[:2])
    result["fused"] = timed_steps(engine, data)
    result["isolated"] = timed_steps(engine, data, isolated=True)
    if not args.skip_unfused:
        engine.executor.fused_head = False
        result["unfused"] = timed_steps(engine, data)
        engine.executor.fused_head = True
    print(json.dumps(result, indent=1), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, data[:1])
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "cpu_time_total"):
        table = averages.table(sort_by=key, row_limit=40, max_name_column_width=70)
        result[key] = table
        print(table, flush=True)
    prof.export_chrome_trace(args.out.replace(".json", "_trace.json"))
    engine.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
