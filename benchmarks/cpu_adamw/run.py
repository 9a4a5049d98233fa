"""Like for like: the Numba CPU AdamW against torch's CPU AdamW, same inputs, same outputs, same threads.

Every implementation gets the same arrays: fp32 parameters and moments, a gradient in each dtype the
Numba kernel takes (fp32, and bf16 as uint16 bit patterns), the same hyperparameters and step; each
updates the state in place and, in the cases "with bf16 copy", also writes the updated parameters as
bf16, all inside the timed call:

* numba: `cpu_adamw.adamw_step(..., impl="numba")`, one pass;
* torch_fused: `adamw_step(..., impl="torch")` (slidedp/backend/kernels/cpu_adamw_torch.py): the kernel of
  `torch.optim.AdamW(fused=True)` through torch's functional AdamW; a bf16 gradient widened into an fp32
  scratch first (torch's AdamW needs the parameter's dtype), the bf16 copy by `Tensor.copy_` after;
* torch_foreach: the same with `AdamW(foreach=True)`'s multi-tensor path.

Before any timing, every implementation runs one step from the same state at every size and case and
its results are compared with numba's: fp32 arrays within 16 ulps (of the larger of the results and the
starting value: an update that cancels the parameter keeps the precision of its terms), and the bf16
copy must be its own parameters rounded to nearest even, bit for bit. If any differ, nothing is timed
or written (exit status 1).

Each case is timed at 1, 4 and all threads (os.cpu_count(); counts above it dropped) with
torch.utils.benchmark's adaptive_autorange (torch's thread count set by the Timer, Numba's team by the
call): median, IQR, and GB/s of state traffic, the bytes every implementation must move (parameters and
moments read and written, the gradient read, the bf16 copy written). torch's scratch and second pass
are not counted: the same work, so GB/s is proportional to speed.

For the target machine (16 cores):

    python3 benchmarks/cpu_adamw/run.py --out benchmarks/cpu_adamw/results/<date>-<host>.json

(outside a git checkout, with BENCH_GIT_COMMIT=<commit> set). It prints, and records as
`torch_faster`, the cases where torch_fused beat numba by more than `--margin` at every size: the
entries `TORCH_FASTER` in slidedp/backend/kernels/cpu_adamw.py should then hold.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import socket
import sys
import timeit
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository root first
    sys.path.insert(0, str(_REPO))

# The optimizer first, so that it picks Numba's threading layer before anything else launches it.
from slidedp.backend.kernels import cpu_adamw, cpu_adamw_torch  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, host_description, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table, num  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils import benchmark  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
FIRST_STEP = 10  # moments already warm (bias corrections away from their first-step values)
# of the largest of the two results and the starting value (fp32_diff): torch foreach's formula rounds a few
# ulps of the update's terms away from the others' (up to 6 seen); a wrong weight decay or bias correction
# is off by 80 and more
FP32_ULPS_MAX = 16
GRAD_DTYPES = ("fp32", "bf16")
# bytes per element every implementation must move: p, m, v read and written; the gradient read;
# the bf16 copy written
STATE_BYTES = 3 * 4 * 2
GRAD_BYTES = {"fp32": 4, "bf16": 2}
COPY_BYTES = 2
_COMPARE_CHUNK = 1 << 22


def _numba(arrays, out, step, threads):
    p, g, m, v = arrays
    cpu_adamw.adamw_step(p, g, m, v, out, step=step, num_threads=threads, impl="numba", **HYPER)


def _torch_fused(arrays, out, step, threads):
    p, g, m, v = arrays
    cpu_adamw.adamw_step(p, g, m, v, out, step=step, num_threads=threads, impl="torch", **HYPER)


def _torch_foreach(arrays, out, step, threads):
    p, g, m, v = arrays
    cpu_adamw_torch.adamw_step_torch(p, g, m, v, out, step=step, num_threads=threads, variant="foreach", **HYPER)


# name -> fn(arrays=(param, grad, exp_avg, exp_avg_sq), out_bf16 or None, step, threads); numba first:
# the others are checked against it
IMPLS = {"numba": _numba, "torch_fused": _torch_fused, "torch_foreach": _torch_foreach}


class ResultsDiffer(SystemExit):
    """An implementation's results are not numba's: the study records nothing."""


def parse_count(text: str) -> int:
    """'16M' -> 16 * 2**20 (suffixes k, M, G are powers of 2**10)."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    n = int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(float(t))
    if n < 1:
        raise argparse.ArgumentTypeError(f"need at least 1 element, got {text!r}")
    return n


def default_threads() -> list[int]:
    """1, 4 and all (os.cpu_count()), none above what the machine (and Numba) has."""
    top = min(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
    return sorted({t for t in (1, 4, top) if t <= top})


def default_out() -> Path:
    host = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.") or "host"
    return _REPO / "benchmarks" / "cpu_adamw" / "results" / f"{dt.datetime.now(dt.timezone.utc).date()}-{host}.json"


def _simd_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("fma", "avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16") if f in have]
    except OSError:
        pass
    return []


def _host_array(numel: int, dtype: torch.dtype) -> np.ndarray:
    """A numpy view of a torch-allocated buffer, as slidedp's host state is (64-byte aligned)."""
    t = torch.empty(numel, dtype=dtype)
    a = t.numpy()
    return a.view(np.uint16) if dtype == torch.int16 else a


class Inputs:
    """The same starting state for every implementation: fp32 param and moments, a gradient of one dtype."""

    def __init__(self, numel: int, grad_dtype: str, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.numel, self.grad_dtype = numel, grad_dtype
        self.param = _host_array(numel, torch.float32)
        self.param[:] = rng.standard_normal(numel, dtype=np.float32)
        self.exp_avg = _host_array(numel, torch.float32)
        self.exp_avg[:] = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-2)
        self.exp_avg_sq = _host_array(numel, torch.float32)
        self.exp_avg_sq[:] = np.square(rng.standard_normal(numel, dtype=np.float32)) * np.float32(1e-4)
        g = rng.standard_normal(numel, dtype=np.float32)
        if grad_dtype == "bf16":
            self.grad = _host_array(numel, torch.int16)
            self.grad[:] = torch.from_numpy(g).to(torch.bfloat16).view(torch.uint16).numpy()
        else:
            self.grad = _host_array(numel, torch.float32)
            self.grad[:] = g
        # what the implementations update (reset from the inputs before each one)
        self.work = [_host_array(numel, torch.float32) for _ in range(3)]
        self.out_bf16 = _host_array(numel, torch.int16)

    def reset(self) -> tuple:
        """(param, grad, exp_avg, exp_avg_sq) to update, set to the starting state."""
        for dst, src in zip(self.work, (self.param, self.exp_avg, self.exp_avg_sq)):
            np.copyto(dst, src)
        self.out_bf16.fill(0)
        p, m, v = self.work
        return p, self.grad, m, v


def fp32_diff(a: np.ndarray, b: np.ndarray, start: np.ndarray) -> tuple[float, float]:
    """(largest |a - b|, largest |a - b| in ulps of the largest of |a|, |b| and |start|), element by element.

    The starting value is in the scale so that a result near 0 by cancellation (p + update with p close to
    -update) is judged at the precision of its terms. NaN anywhere gives inf."""
    worst_abs = worst_ulps = 0.0
    for lo in range(0, a.size, _COMPARE_CHUNK):
        x, y, s = (z[lo:lo + _COMPARE_CHUNK] for z in (a, b, start))
        d = np.abs(x.astype(np.float64) - y)
        scale = np.spacing(np.maximum(np.maximum(np.abs(x), np.abs(y)), np.abs(s))).astype(np.float64)
        chunk_abs, chunk_ulps = float(np.max(d, initial=0.0)), float(np.max(d / scale, initial=0.0))
        if chunk_abs != chunk_abs or chunk_ulps != chunk_ulps:
            return float("inf"), float("inf")
        worst_abs, worst_ulps = max(worst_abs, chunk_abs), max(worst_ulps, chunk_ulps)
    return worst_abs, worst_ulps


def _bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits).view(torch.bfloat16).float().numpy()


def _is_rounded_copy(out_bf16: np.ndarray, param: np.ndarray) -> bool:
    """Whether `out_bf16` is `param` rounded to bf16 as torch rounds (nearest even), bit for bit."""
    for lo in range(0, param.size, _COMPARE_CHUNK):
        want = torch.from_numpy(param[lo:lo + _COMPARE_CHUNK]).to(torch.bfloat16).view(torch.uint16).numpy()
        if not np.array_equal(out_bf16[lo:lo + _COMPARE_CHUNK], want):
            return False
    return True


def verify(inputs: Inputs, impls: list[str], bf16_copy: bool, threads: int) -> list[dict]:
    """One step of every implementation from the same state. Each one's fp32 results must be within
    FP32_ULPS_MAX (`fp32_diff`) of the first's, and its bf16 copy its own parameters rounded, bit for bit
    (so the copies differ only where the fp32 parameters straddle a bf16 rounding boundary)."""
    rows, ref = [], None
    starts = (inputs.param, inputs.exp_avg, inputs.exp_avg_sq)
    for name in impls:
        arrays = inputs.reset()
        out = inputs.out_bf16 if bf16_copy else None
        IMPLS[name](arrays, out, FIRST_STEP, threads)
        result = [a.copy() for a in (arrays[0], arrays[2], arrays[3])] + ([out.copy()] if bf16_copy else [])
        if ref is None:
            ref_name, ref = name, result
        row = dict(numel=inputs.numel, grad_dtype=inputs.grad_dtype, bf16_copy=bf16_copy, impl=name,
                   against=ref_name if result is not ref else None)
        ok = True
        for key, x, y, s0 in zip(("param", "exp_avg", "exp_avg_sq"), result, ref, starts):
            row[f"{key}_max_abs_diff"], row[f"{key}_max_ulps"] = fp32_diff(x, y, s0)
            ok = ok and row[f"{key}_max_ulps"] <= FP32_ULPS_MAX
        if bf16_copy:
            row["bf16_copy_is_rounded_param"] = _is_rounded_copy(result[3], result[0])
            row["bf16_copy_max_abs_diff"] = fp32_diff(_bf16_as_f32(result[3]), _bf16_as_f32(ref[3]), result[0])[0]
            row["bf16_copy_mismatches"] = int(np.count_nonzero(result[3] != ref[3]))
            ok = ok and row["bf16_copy_is_rounded_param"]
        row["ok"] = ok
        rows.append(row)
    return rows


def time_case(fn, inputs: Inputs, bf16_copy: bool, threads: int, *, min_run_s: float, max_run_s: float) -> dict:
    """Median and IQR of one implementation's step at `threads` threads (torch's and Numba's); the
    caller's thread counts are restored after (main() also runs inside other processes: the tests)."""
    arrays = inputs.reset()
    out = inputs.out_bf16 if bf16_copy else None
    step = FIRST_STEP

    def one_step():
        nonlocal step
        fn(arrays, out, step, threads)
        step += 1

    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    try:
        one_step()  # warm-up
        timer = benchmark.Timer(stmt="one_step()", globals={"one_step": one_step}, num_threads=threads,
                                timer=timeit.default_timer)
        m = timer.adaptive_autorange(threshold=0.05, min_run_time=min_run_s, max_run_time=max_run_s)
        if torch.get_num_threads() != threads:
            raise SystemExit(f"torch ran with {torch.get_num_threads()} threads, not {threads}")
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)
    nbytes = inputs.numel * (STATE_BYTES + GRAD_BYTES[inputs.grad_dtype] + (COPY_BYTES if bf16_copy else 0))
    return dict(median_s=m.median, iqr_s=m.iqr, calls=m.number_per_run * len(m.raw_times),
                state_bytes=nbytes, state_gb_per_s=nbytes / m.median / 1e9)


def compare(cases: list[dict], margin: float) -> tuple[list[dict], list[list]]:
    """Per (numel, grad dtype, bf16 copy, threads): each torch implementation's time over numba's, and the
    TORCH_FASTER keys (threads bucket, bf16 copy, grad dtype) where torch_fused beat numba by more than
    `margin` at every size measured."""
    by = {(c["numel"], c["grad_dtype"], c["bf16_copy"], c["threads"], c["impl"]): c for c in cases}
    rows, verdicts = [], {}
    for (numel, dtype, copy, threads, impl), c in by.items():
        if impl != "numba":
            continue
        row = dict(numel=numel, grad_dtype=dtype, bf16_copy=copy, threads=threads, numba_s=c["median_s"])
        for other in ("torch_fused", "torch_foreach"):
            o = by.get((numel, dtype, copy, threads, other))
            row[f"{other}_s"] = o["median_s"] if o else None
            row[f"{other}_over_numba"] = o["median_s"] / c["median_s"] if o else None
        fused = row["torch_fused_s"]
        row["numba_at_least_as_fast"] = fused is None or c["median_s"] <= fused
        row["torch_fused_faster"] = fused is not None and fused < c["median_s"] * (1 - margin)
        rows.append(row)
        key = (cpu_adamw.threads_bucket(threads), copy, dtype)
        verdicts.setdefault(key, []).append(row["torch_fused_faster"])
    torch_faster = sorted([list(k) for k, v in verdicts.items() if all(v)])
    return rows, torch_faster


def render_table(record: dict) -> str:
    """Markdown: one row per size, gradient dtype, bf16 copy and thread count."""
    head = ["elements", "grad", "bf16 copy", "threads", "numba ms", "torch fused ms", "torch foreach ms",
            "numba GB/s", "torch fused / numba", "faster"]
    gbs = {(c["numel"], c["grad_dtype"], c["bf16_copy"], c["threads"]): c["state_gb_per_s"]
           for c in record["cases"] if c["impl"] == "numba"}
    rows = []
    for r in record["comparisons"]:
        ms = [num(None if s is None else s * 1e3, ".3g") for s in (r["numba_s"], r["torch_fused_s"], r["torch_foreach_s"])]
        faster = "torch fused" if r["torch_fused_faster"] else "numba" if r["numba_at_least_as_fast"] else "within margin"
        rows.append([f"{r['numel']:,}", r["grad_dtype"], "yes" if r["bf16_copy"] else "no", r["threads"], *ms,
                     num(gbs[(r["numel"], r["grad_dtype"], r["bf16_copy"], r["threads"])], ".1f"),
                     num(r["torch_fused_over_numba"], ".2f") + "x", faster])
    host = record["host"]
    intro = (f"{host['host_cpu']}, {host['host_cores']} cores ({', '.join(record['simd']) or 'no SIMD flags read'}); "
             f"torch {record['torch_version']}, numba {record['numba_version']} [{record['threading_layer']}]. "
             f"torch faster by more than {record['margin']:.0%} in: "
             + (", ".join(str(tuple(k)) for k in record["torch_faster"]) or "no case") + ".")
    return intro + "\n\n" + markdown_table(head, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=parse_count, nargs="+", default=None,
                    help="elements per update, suffix k/M/G = 2**10/2**20/2**30 (default 16M 64M)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default 1, 4 and all)")
    ap.add_argument("--grad-dtypes", nargs="+", choices=GRAD_DTYPES, default=list(GRAD_DTYPES))
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS),
                    help="implementations (numba is always included, first)")
    ap.add_argument("--min-run-s", type=float, default=1.0, help="least timed seconds per case")
    ap.add_argument("--max-run-s", type=float, default=6.0, help="most timed seconds per case")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="torch counts as faster when its median is below numba's by more than this fraction")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and short timings (tests)")
    ap.add_argument("--out", type=Path, default=None, help="the record (default results/<date>-<host>.json)")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    top = min(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
    numels = args.numel or ([40_009] if args.quick else [16 << 20, 64 << 20])
    threads = sorted(set(args.threads)) if args.threads else ([t for t in (1, 2) if t <= top] if args.quick
                                                               else default_threads())
    if any(not 1 <= t <= top for t in threads):
        ap.error(f"--threads must be between 1 and {top} (os.cpu_count() and NUMBA_NUM_THREADS)")
    if args.quick:
        args.min_run_s, args.max_run_s = 0.01, 0.05
    impls = ["numba"] + [i for i in args.impls if i != "numba"]
    out_path = args.out or default_out()
    stamp = commit_stamp(args.allow_dirty)  # before measuring: a dirty tree is refused at once
    cpu_adamw.threading_layer()  # launch Numba's pool before torch's threads are set
    command = shlex.join(["python", os.path.relpath(Path(__file__).resolve(), _REPO),
                          *(sys.argv[1:] if argv is None else argv)])
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    checks = []
    for numel in numels:
        for dtype in args.grad_dtypes:
            inputs = Inputs(numel, dtype)
            for copy in (False, True):
                checks += verify(inputs, impls, copy, threads[-1])
            del inputs
    bad = [c for c in checks if not c["ok"]]
    for c in checks:
        print(f"check {c['impl']:>13} vs {c['against'] or 'itself'}: {c['numel']:,} {c['grad_dtype']} "
              f"copy={c['bf16_copy']!s:<5}: max ulps p/m/v {c['param_max_ulps']:.2g}/{c['exp_avg_max_ulps']:.2g}/"
              f"{c['exp_avg_sq_max_ulps']:.2g} (max abs diff p {c['param_max_abs_diff']:.2g})"
              + (f"; bf16 copy: its own parameters rounded {c['bf16_copy_is_rounded_param']}, "
                 f"{c['bf16_copy_mismatches']} differ from {c['against'] or 'itself'}" if c["bf16_copy"] else "")
              + ("" if c["ok"] else "  DIFFERENT"), flush=True)
    if bad:
        raise ResultsDiffer(f"{len(bad)} of {len(checks)} checks differ from numba (beyond {FP32_ULPS_MAX} fp32 ulps, "
                            f"or a bf16 copy that is not its parameters rounded): nothing timed, nothing recorded")

    cases = []
    for numel in numels:
        for dtype in args.grad_dtypes:
            inputs = Inputs(numel, dtype)
            for copy in (False, True):
                for t in threads:
                    for name in impls:
                        c = dict(numel=numel, grad_dtype=dtype, bf16_copy=copy, threads=t, impl=name,
                                 **time_case(IMPLS[name], inputs, copy, t, min_run_s=args.min_run_s,
                                             max_run_s=args.max_run_s))
                        cases.append(c)
                        print(f"{numel:>12,} {dtype} copy={copy!s:<5} {t:>3} threads {name:>13}: "
                              f"{c['median_s'] * 1e3:9.2f} ms (IQR {c['iqr_s'] * 1e3:.2f}, {c['calls']} calls) "
                              f"{c['state_gb_per_s']:7.1f} GB/s", flush=True)
            del inputs
    comparisons, torch_faster = compare(cases, args.margin)

    record = dict(
        **stamp, study="cpu_adamw", date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command=command, host=host_description(), simd=_simd_flags(), torch_version=torch.__version__,
        numba_version=numba.__version__, threading_layer=cpu_adamw.threading_layer(),
        load_avg_1min_before=load_before,
        load_avg_1min_after=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        hyper=dict(HYPER, first_step=FIRST_STEP), numel=numels, threads=threads, grad_dtypes=args.grad_dtypes,
        impls=impls, min_run_s=args.min_run_s, max_run_s=args.max_run_s, margin=args.margin,
        tolerance=dict(fp32_ulps=FP32_ULPS_MAX, bf16_copy="its own parameters rounded, bit for bit"),
        checks=checks, cases=cases, comparisons=comparisons, torch_faster=torch_faster)
    write_records(out_path, record)
    print()
    print(render_table(record))
    print()
    if torch_faster:
        keys = ", ".join(repr(tuple(k)) for k in torch_faster)
        print(f"TORCH_FASTER (slidedp/backend/kernels/cpu_adamw.py) should be frozenset({{{keys}}})")
    else:
        print("numba within the margin of torch fused or faster in every case: TORCH_FASTER stays empty")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
