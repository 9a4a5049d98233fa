"""The link's copies while the CPU AdamW runs: does host DRAM traffic of the optimizer slow the DMA?

    python benchmarks/tools/copies_under_adamw.py [--gib 1] [--numel 134217728] [--threads N]

Times H2D alone, D2H alone and both at once on pinned buffers with slidedp.profiler.calibrate's own
measurements, each first with the host idle, then beside slidedp's CPU AdamW (the numba kernel, bf16
gradient in, bf16 weights out, over `--numel` parameters on a thread of its own: calibrate's
`beside_adamw`). Prints GB/s and the fraction kept beside the AdamW; with --out, writes them as
JSON. The duplex fraction is what `slidedp calibrate` records as duplex_contended_fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slidedp.profiler import calibrate as cal  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes per copy [GiB]")
    p.add_argument("--numel", type=int, default=2**27, help="AdamW parameters")
    p.add_argument("--threads", type=int, default=(os.cpu_count() or 2) - 1, help="AdamW threads")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    buffers = cal.CopyBuffers(torch.device("cuda"), int(args.gib * 2**30))
    n, reps = buffers.nbytes, args.repeats
    cases = {  # (seconds of the copy, directions)
        "h2d": (lambda: cal.measure_h2d_by_size(buffers, [n], repeats=reps)[0][1], 1),
        "d2h": (lambda: cal.measure_d2h_s(buffers, repeats=reps), 1),
        "duplex": (lambda: cal.measure_duplex_s(buffers, repeats=reps), 2),
    }
    state = cal.AdamwState(args.numel)
    state.step(args.threads)  # compile outside the timings
    alone_s = cal.measure_adamw_s(state, [args.threads], repeats=reps)[0][1]
    result = {"gpu": torch.cuda.get_device_name(), "cpu_cores": os.cpu_count(), "threads": args.threads,
              "copy_bytes": n, "adamw_numel": args.numel, "adamw_params_per_s": args.numel / alone_s}
    for name, (seconds, directions) in cases.items():
        idle, busy = seconds(), cal.beside_adamw(state, args.threads, seconds)
        rate_idle, rate_busy = directions * n / idle, directions * n / busy
        result[name] = {"idle_GBps": rate_idle / 1e9, "under_adamw_GBps": rate_busy / 1e9,
                        "fraction": rate_busy / rate_idle}
        print(f"{name:7s} idle {rate_idle / 1e9:6.1f} GB/s, beside the AdamW ({args.threads} threads) "
              f"{rate_busy / 1e9:6.1f} GB/s: {rate_busy / rate_idle:.3f}", flush=True)
    print(f"AdamW alone {args.numel / alone_s / 1e9:.2f} G params/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
