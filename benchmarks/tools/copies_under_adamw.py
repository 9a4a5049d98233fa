"""The link's copies while the CPU AdamW runs: does host DRAM traffic of the optimizer slow the DMA?

    python benchmarks/tools/copies_under_adamw.py [--gib 1] [--numel 134217728] [--threads N]

Times (CUDA events) H2D alone, D2H alone and both at once on pinned buffers, each first with the
host idle, then while slidedp's CPU AdamW (the numba kernel, bf16 gradient in, bf16 weights out)
runs on a thread of its own over `--numel` parameters. Prints GB/s and the fraction kept under
the AdamW; with --out, writes them as JSON. The cost model's link rates are measured with the host
idle (slidedp.profiler.calibrate); this says whether they hold while the CPU updates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slidedp.profiler.calibrate import AdamwState, CopyBuffers, beside_adamw  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` (CUDA events around it on the current stream)."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes per copy [GiB]")
    p.add_argument("--numel", type=int, default=2**27, help="AdamW parameters")
    p.add_argument("--threads", type=int, default=(os.cpu_count() or 2) - 1, help="AdamW threads")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    buffers = CopyBuffers(torch.device("cuda"), int(args.gib * 2**30))
    current, up, down = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        for stream, copy in ((up, buffers.h2d), (down, buffers.d2h)):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                copy()
        current.wait_stream(up)
        current.wait_stream(down)

    cases = {"h2d": (buffers.h2d, 1), "d2h": (buffers.d2h, 1), "duplex": (both, 2)}
    state = AdamwState(args.numel)
    state.step(args.threads)  # compile outside the timings
    t0 = time.perf_counter()
    state.step(args.threads)
    adamw_alone_s = time.perf_counter() - t0
    result = {"gpu": torch.cuda.get_device_name(), "cpu_cores": os.cpu_count(), "threads": args.threads,
              "copy_bytes": buffers.nbytes, "adamw_numel": args.numel, "adamw_alone_s": adamw_alone_s}
    for name, (fn, directions) in cases.items():
        fn()
        idle = timed(fn, args.repeats)
        steps, count = [0], state.step

        def step(threads: int) -> None:
            count(threads)
            steps[0] += 1

        state.step = step  # count the AdamW steps that run beside the copies
        try:
            t0 = time.perf_counter()
            busy, during, wall = beside_adamw(state, args.threads, lambda: (timed(fn, args.repeats), steps[0],
                                                                            time.perf_counter()))
        finally:
            state.step = count
        wall -= t0
        rate_idle, rate_busy = directions * buffers.nbytes / idle, directions * buffers.nbytes / busy
        result[name] = {"idle_GBps": rate_idle / 1e9, "under_adamw_GBps": rate_busy / 1e9,
                        "fraction": rate_busy / rate_idle, "adamw_steps": during,
                        "adamw_params_per_s": during * args.numel / max(wall, 1e-9)}
        print(f"{name:7s} idle {rate_idle / 1e9:6.1f} GB/s, under AdamW ({args.threads} threads) "
              f"{rate_busy / 1e9:6.1f} GB/s: {rate_busy / rate_idle:.3f}", flush=True)
    print(f"AdamW alone {args.numel / adamw_alone_s / 1e9:.2f} G params/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
