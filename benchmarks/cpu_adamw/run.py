"""Throughput of the Numba CPU AdamW against torch.optim.AdamW(fused=True) on this CPU.

Both sides do the work one optimizer step does in slidedp, on one flat tensor of
`--params` elements:

* numba: `adamw_step` with a bf16 gradient in (uint16 bits) and the updated weights written
  as bf16 in the same pass (fp32 master weights and moments updated in place).
* torch: `opt.step()` of `AdamW(fused=True)` with an fp32 gradient (torch AdamW cannot take a
  bf16 gradient for fp32 parameters, so in practice it receives fp32 gradients), then
  `w_bf16.copy_(param)` to produce the bf16 weights.

Runs are interleaved (numba, torch, torch without the copy, repeat) so that changing load on
the machine hits both sides alike; reports the median of the repeats after a warm-up.

    python benchmarks/cpu_adamw/run.py [--params 64M] [--threads N] [--repeats 7]

Appends records to benchmarks/cpu_adamw/results/<today>-cpu-adamw.json (a JSON list; `--json ''` to skip).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Import the optimizer first so it picks Numba's threading layer before anything else.
from slidedp.backend.kernels import cpu_adamw  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import numba  # noqa: E402
import torch  # noqa: E402

_HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Bytes each element moves per step (reads + writes), for the effective-bandwidth column.
_BYTES_NUMBA = 4 * 3 * 2 + 2 + 2  # p, m, v read+write; bf16 grad read; bf16 weight write
_BYTES_TORCH = 4 * 3 * 2 + 4 + 4 + 2  # p, m, v read+write; fp32 grad; copy: p read, bf16 write
_BYTES_TORCH_NOCOPY = 4 * 3 * 2 + 4


def _parse_count(text: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="64M",
                    help="number of parameters, suffix k/M/G = 2**10/2**20/2**30 (default 64M)")
    ap.add_argument("--threads", type=int, default=_usable_cpus(),
                    help="threads for both sides (default: usable CPUs)")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per side (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--json", default=str(_REPO / "benchmarks" / "cpu_adamw" / "results" / f"{dt.date.today()}-cpu-adamw.json"),
                    help="JSON record list to append to ('' to skip)")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    n = _parse_count(args.params)
    threads = args.threads
    if n < 1 or threads < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--params, --threads and --repeats must be >= 1, --warmup >= 0")
    stamp = commit_stamp(args.allow_dirty)  # before measuring: a dirty tree is refused at once

    cpu_adamw.set_num_threads(threads)
    cpu_adamw.threading_layer()  # launch Numba's pool first: it must not change torch's threads
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)

    # numba side: fp32 state, bf16 grad bits in, bf16 weight bits out. Buffers come from
    # torch's allocator, as slidedp's host state does (64-byte aligned; numpy would give
    # 16-byte alignment but transparent huge pages, which torch tensors do not get).
    def host(dtype: torch.dtype) -> np.ndarray:
        return torch.zeros(n, dtype=dtype).numpy()

    p_np, m_np, v_np = host(torch.float32), host(torch.float32), host(torch.float32)
    p_np[:] = rng.standard_normal(n, dtype=np.float32)
    g_bf16 = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)).to(torch.bfloat16)
    g_np = host(torch.int16).view(np.uint16)
    g_np[:] = g_bf16.view(torch.uint16).numpy()
    w_np = host(torch.int16).view(np.uint16)

    # torch side: same values, fp32 grad (the bf16 gradient upcast), bf16 weight copy.
    p_t = torch.nn.Parameter(torch.from_numpy(p_np.copy()))
    p_t.grad = g_bf16.float()
    w_t = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p_t], lr=_HYPER["lr"], betas=(_HYPER["beta1"], _HYPER["beta2"]),
                            eps=_HYPER["eps"], weight_decay=_HYPER["weight_decay"], fused=True)

    step = 0

    def run_numba() -> None:
        nonlocal step
        step += 1
        cpu_adamw.adamw_step(p_np, g_np, m_np, v_np, w_np, step=step, **_HYPER)

    def run_torch() -> None:
        opt.step()
        w_t.copy_(p_t.detach())

    def run_torch_nocopy() -> None:
        opt.step()

    cases = [("numba adamw_step (bf16 grad in, bf16 w out)", run_numba, _BYTES_NUMBA),
             ("torch AdamW fused + w_bf16.copy_ (fp32 grad)", run_torch, _BYTES_TORCH),
             ("torch AdamW fused, no bf16 copy (fp32 grad)", run_torch_nocopy, _BYTES_TORCH_NOCOPY)]
    with torch.no_grad():
        for _, fn, _ in cases:
            for _ in range(args.warmup):
                fn()
        times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        for _ in range(args.repeats):
            for name, fn, _ in cases:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)

    load_1min = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if torch.get_num_threads() != threads:
        raise SystemExit(f"torch ran with {torch.get_num_threads()} threads, not {threads}")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    rates = {name: n / medians[name] / 1e9 for name in medians}
    torch_name = cases[1][0]
    cpu = _cpu_model()
    print(f"CPU AdamW, {n:,} params, {threads} threads, median of {args.repeats} "
          f"(warm-up {args.warmup}); CPU: {cpu} ({_usable_cpus()} usable); "
          f"numba {numba.__version__} [{cpu_adamw.threading_layer()}], torch {torch.__version__}; "
          f"load average (1 min) {load_1min:.2f}")
    print("torch AdamW cannot take bf16 grads for fp32 params: torch gets the same gradient "
          "upcast to fp32 (what it gets in practice); numba reads the bf16 bits.")
    hdr = f"{'system':<48} {'ms/step':>9} {'Gparam/s':>9} {'GB/s':>7} {'vs torch fused':>15}"
    print(hdr)
    print("-" * len(hdr))
    for name, _, nbytes in cases:
        ratio = rates[name] / rates[torch_name]
        print(f"{name:<48} {medians[name] * 1e3:>9.1f} {rates[name]:>9.3f} "
              f"{n * nbytes / medians[name] / 1e9:>7.1f} {ratio:>14.2f}x")
    ratio = rates[cases[0][0]] / rates[torch_name]
    print(f"ratio numba / torch fused (both writing bf16 weights): {ratio:.2f}x")

    if args.json:
        date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        command = shlex.join(["python", os.path.relpath(__file__, _REPO),
                              *(sys.argv[1:] if argv is None else argv)])
        common = dict(params=n, threads=threads, cpu_model=cpu, usable_cpus=_usable_cpus(),
                      date=date, command=command, repeats=args.repeats, warmup=args.warmup,
                      numba_version=numba.__version__, torch_version=torch.__version__,
                      threading_layer=cpu_adamw.threading_layer(),
                      load_avg_1min=round(load_1min, 2), **stamp)
        records = [dict(system=name, gparams_per_s=round(rates[name], 4),
                        ratio_vs_torch_fused=round(rates[name] / rates[torch_name], 3),
                        median_s=round(medians[name], 5),
                        grad_dtype="bf16" if fn is run_numba else "fp32",
                        writes_bf16_weights=fn is not run_torch_nocopy, **common)
                   for name, fn, _ in cases]
        path = Path(args.json)
        existing = []
        if path.exists():
            existing = json.loads(path.read_text() or "[]")
            if not isinstance(existing, list):
                raise SystemExit(f"{path} does not hold a JSON list")
        path.write_text(json.dumps(existing + records, indent=1) + "\n")
        print(f"appended {len(records)} records to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
