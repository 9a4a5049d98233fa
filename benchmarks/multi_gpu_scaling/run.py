"""Multi-GPU scaling (issue 8): slidedp's data parallelism over 1, 2, 4 (and 8) GPUs of one host,
for each route combination, against FSDP2 with CPUOffloadPolicy and GPU-resident FSDP2, in one run,
on the same random-init Qwen3 model (4B or 8B shape, seq 4096) and the same global batches.

Measured: strong scaling at 65,536 tokens per step (16 sequences, split over the GPUs) and weak
scaling at 16,384 tokens per GPU (4 sequences each); tokens/s, step time measured and predicted
(slidedp's plan), peak device memory of the busiest rank, and the host memory of the whole point
(every process it started). Targets of the issue (checked under the table): strong-scaling
efficiency >= 90% from 1 to 4 GPUs at 65,536 tokens/step, >= 1.5x FSDP2 with CPU offload at every
point, host memory flat in the number of GPUs, predicted step time within 15% of measured.

Commands for a 4-GPU machine. First, without a GPU: solve every slidedp plan for the H200 preset,
so that the GPU time is spent measuring (CP-SAT, about half a minute a plan on 2 cores; they go to
benchmarks/multi_gpu_scaling/results/plans/, which git ignores: copy them along with the tree):

    python benchmarks/multi_gpu_scaling/run.py --solve-plans --shape 4b --world-sizes 1 2 4 --mode both \\
        --hardware h200-sxm
    python benchmarks/multi_gpu_scaling/run.py --solve-plans --shape 8b --world-sizes 1 2 4 --mode both \\
        --hardware h200-sxm

On the GPU machine, each command a few points (one may run 10 minutes; a 4B point takes minutes, most of
it building the host state), its records in $OUT (the only folder that comes back). --reuse-plans
takes the plans above (a plan this machine's model no longer matches is solved there again);
--host-ram because MemTotal grows there as memory is used, so /proc/meminfo under-reports it. In the
order that answers the targets first (strong scaling of slidedp and FSDP2 with CPU offload, then
every route with 4 GPUs, then weak scaling, GPU-resident FSDP2 and the 8B shape):

    L="python3 benchmarks/multi_gpu_scaling/run.py --reuse-plans --plans-dir benchmarks/multi_gpu_scaling/results/plans \\
       --host-ram 500GiB --timeout-s 560 --out $OUT/scaling.json --merge"
    $L --shape 4b --mode strong --world-sizes 1 --systems slidedp fsdp2_cpu_offload
    $L --shape 4b --mode strong --world-sizes 2 --systems slidedp fsdp2_cpu_offload --routes auto
    $L --shape 4b --mode strong --world-sizes 4 --systems slidedp fsdp2_cpu_offload --routes auto
    $L --shape 4b --mode strong --world-sizes 4 --systems slidedp --routes replicated/cpu replicated/gpu
    $L --shape 4b --mode strong --world-sizes 4 --systems slidedp --routes sharded/cpu sharded/gpu
    $L --shape 4b --mode weak --world-sizes 1 2 --systems slidedp fsdp2_cpu_offload --routes auto
    $L --shape 4b --mode both --world-sizes 1 2 4 --systems fsdp2_gpu
    (then the routes with 2 GPUs, and the same for --shape 8b)

Back here, each command's scaling.json copied beside the records (as results/<date>-<what>.json):
merge them (a later file's point replaces an earlier one's) into the records and the README section:

    python benchmarks/multi_gpu_scaling/run.py --render PART1.json PART2.json \\
        --out benchmarks/multi_gpu_scaling/results/<date>-<what>.json --readme

On a machine that keeps its files, one command does it all:
`python3 benchmarks/multi_gpu_scaling/run.py --shape 4b --mode both --reuse-plans --host-ram 500GiB --merge
--readme` (all systems and routes, 1, 2 and 4 GPUs, records merged into results/<date>-qwen3-<shape>.json).

CPU smoke (gloo, CPU processes; what tests/benchmarks/test_multi_gpu_scaling.py runs):

    python benchmarks/multi_gpu_scaling/run.py --shape tiny --device cpu --world-sizes 1 2 --mode weak --steps 1 \\
        --out /tmp/scale.json

Each point (system, route, GPUs, tokens per step) runs in a fresh child process of this script, one
after the other, with a timeout (benchmarks/common/child.py's `run_child`); a point that fails,
runs out of memory, times out or cannot run here (too few GPUs, too little host RAM, a budget too
small) becomes a record with an "error" and null numbers, never the end of the run. The model, the
initial weights (one seeded generator per parameter, rounded to bf16), the batches, AdamW (lr 1e-5,
betas (0.9, 0.999), eps 1e-8, no weight decay), clipping to 1.0 and the token-weighted loss are
those of single_gpu_throughput (benchmarks/common/model.py and systems.py, whose Point and worker
this script extends); a step's global batch is the
same in every system and for every number of GPUs (rank r takes the r-th share of its rows).

* slidedp: `slidedp.compile(model, budget, batch_size=1, seq_len=seq, world_size=W,
  micro_batches=rows per GPU)` (one worker process per GPU, started by compile; the host state once,
  in shared memory). The plan comes from `slidedp.plan(..., solver_options=SolverOptions(
  deliveries=(d,), reductions=(r,)))` for a route d/r, or without options for `auto` (the solver's
  own choice), and is passed as `plan=`. With one GPU there is only (replicated, cpu): that point is
  the base of every route's efficiency. The record names the routes the plan actually has, per layer
  group, for the layers that stream (those whose optimizer state the plan keeps on the GPUs use
  neither route).
* fsdp2_cpu_offload / fsdp2_gpu: W processes (this point's process is rank 0 and starts the others),
  one GPU each, process group "cpu:gloo,cuda:nccl", `fully_shard` per decoder layer and on the root
  over a mesh of W, with `CPUOffloadPolicy(pin_memory=True)` / without offload,
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, activation checkpointing of every
  block, fused AdamW, global clipping; each rank's loss is divided by the global batch's tokens and
  multiplied by W (FSDP2 averages gradients over ranks), so the gradient is that of the global batch.
  fsdp2_gpu is recorded as "does not fit" without running when its sharded fp32 weights, gradients
  and AdamW moments (16 bytes per parameter / W) exceed a GPU, and as "out of memory" when it runs
  out. `--cap-baselines` holds both FSDP2 systems to the slidedp budget per GPU
  (torch.cuda.set_per_process_memory_fraction); by default they may use the whole GPU.

Step time: 1 warm-up step (= training step 1), then `--steps` timed steps between two
synchronisations on rank 0 (FSDP2: CUDA synchronisation and a barrier of every rank; slidedp: its
step returns when every rank has finished, and its last asynchronous CPU update is waited for inside
the timed region). measured_step_s is the mean of every timed step; median_step_s, mean_step_s and
tokens_per_s (from the median) are over the steady steps, those but the first and the last
(benchmarks/common/steady.py; "steady_steps", "steady_rule"); fewer than 10 steady steps: "few_steps":
true, marked in the table (default --steps 12). peak_device_bytes: torch.cuda.max_memory_allocated after the build, the largest
over the ranks (per rank in peak_device_bytes_per_rank). peak_host_bytes: the peak of the summed
proportional set size (PSS, /proc/PID/smaps_rollup) of the point's process and every process it
started, sampled every second and at the ends of the timed region: a page shared by n processes
counts 1/n in each, so slidedp's shared host state counts once. Pinned buffers that the CUDA driver
maps outside the page tables may escape PSS: host_used_bytes (the machine's MemTotal - MemAvailable
above its value at the start of the point) counts every page. Derived in the table: strong / weak
efficiency = tokens/s(W) / (W x tokens/s(1 GPU)) at the same tokens per step / per GPU, the ratio
to FSDP2 with CPU offload at the same point, host memory against 1 GPU at the same tokens per GPU,
and measured over predicted step time.

Every process of the run has NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off, as the lent multi-GPU machines require) and
TORCHINDUCTOR_COMPILE_THREADS=1 (no idle pool of compile processes per rank in the host memory),
unless the environment sets them otherwise; each record lists them ("env").

On `--device cpu` (smoke test and tests) ranks are CPU processes on gloo, slidedp runs in fp32 with
the "cpu" hardware preset given peer-to-peer between its ranks (gloo carries every route), and
FSDP2 keeps its unsharded parameters on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # run as a script: the repository root, for `benchmarks.common`
    sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.common import model as _model, systems as single  # noqa: E402 - model, data, Point, worker
from benchmarks.common.child import run_child  # noqa: E402
from benchmarks.common.cli import add_model_args, add_record_args  # noqa: E402
from benchmarks.common.hostmem import TreeSampler  # noqa: E402
from benchmarks.common.records import commit_stamp, host_description, write_records  # noqa: E402
from benchmarks.common.steady import marks_note, step_figure  # noqa: E402
from benchmarks.common.tables import gib as _gib, num as _num, update_readme  # noqa: E402

SYSTEMS = ("slidedp", "fsdp2_cpu_offload", "fsdp2_gpu")
ROUTES = ("auto", "replicated/cpu", "replicated/gpu", "sharded/cpu", "sharded/gpu")
NAMES = {"slidedp": "slidedp", "fsdp2_cpu_offload": "FSDP2 + CPU offload", "fsdp2_gpu": "FSDP2 on the GPUs"}
REQUIRED_KEYS = ("system", "route", "shape", "world_size", "tokens_per_step", "tokens_per_rank", "tokens_per_s",
                 "measured_step_s", "predicted_step_s", "peak_device_bytes", "peak_host_bytes", "losses",
                 "budget_bytes", "date", "command", "hardware", "git_commit")
README_BEGIN = "<!-- multi_gpu_scaling:begin -->"
README_END = "<!-- multi_gpu_scaling:end -->"
# Host memory of one point's process beyond the training state (torch, CUDA context, compile workers):
# the preflight's allowance per process.
PROCESS_HOST_BYTES = {"cuda": 4 << 30, "cpu": 1 << 30}
# Set in every process of the run unless already set (each record lists them). NVLink multicast stays
# off (the lent multi-GPU machines require it: a program using it can put the host's shared GPUs out of
# service); torch.compile compiles slidedp's block in each rank's own process, without a pool of
# compile processes per rank that would stay idle and count in the host memory of every rank.
RUN_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
# Targets of issue 8
STRONG_EFFICIENCY_MIN, STRONG_WORLD_SIZE = 0.90, 4
VS_OFFLOAD_MIN = 1.5
PREDICTION_TOLERANCE = 0.15
HOST_FLAT_TOLERANCE = 0.15  # "flat": at most this much above 1 GPU's (each rank adds its own process)


def qwen3_params(shape: str) -> int:
    """Parameters of a Qwen3 shape (untied): embedding and head V*H, final norm H, and per block q/k/v/o
    projections, q/k norms (head_dim each), two RMSNorms and the three MLP matrices."""
    s = _model.SHAPES[shape]
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    block = h * q + 2 * h * kv + q * h + 2 * s["head_dim"] + 2 * h + 3 * h * s["intermediate"]
    return 2 * s["vocab"] * h + h + s["blocks"] * block


def route_options(route: str | None):
    """SolverOptions forcing `route` ("delivery/reduction"); None for "auto" (the solver's choice)."""
    if route in (None, "auto"):
        return None
    from slidedp.scheduler.decisions import SolverOptions

    delivery, reduction = route.split("/")
    return SolverOptions(deliveries=(delivery,), reductions=(reduction,))


def cpu_hardware():
    """The "cpu" preset with peer-to-peer between its ranks (gloo), so that every route can be planned."""
    from slidedp.costmodel.hardware import PRESETS

    cpu = PRESETS["cpu"]
    return replace(cpu, name="cpu-gloo", gpu_p2p_bytes_per_s=cpu.h2d_bytes_per_s)


def default_precision(args) -> str:
    return args.precision or ("bf16" if args.device == "cuda" else "fp32")


def seq_of(args) -> int:
    return args.seq or _model.SHAPES[args.shape]["seq"]


def plan_file(args, world_size: int, tokens: int, route: str) -> Path:
    budget = str(args.budget).replace(" ", "")
    label = route.replace("/", "-")
    return Path(args.plans_dir) / f"qwen3_{args.shape}_{budget}_w{world_size}_{tokens}_{label}.json"


# -- the points -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    system: str
    route: str | None  # slidedp: "auto" or "delivery/reduction"; FSDP2: None
    world_size: int
    tokens_per_step: int

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens_per_step // self.world_size

    def title(self) -> str:
        route = f" {self.route}" if self.route else ""
        return f"{self.system}{route}, {self.world_size} GPU(s), {self.tokens_per_step} tokens/step"


def modes_of(args, world_size: int, tokens: int) -> list[str]:
    out = []
    if args.mode in ("strong", "both") and tokens == args.strong_tokens:
        out.append("strong")
    if args.mode in ("weak", "both") and tokens == args.weak_tokens_per_rank * world_size:
        out.append("weak")
    return out


def points(args) -> list[Spec]:
    """Every point of the run, by number of GPUs, then tokens, then system and route. With one GPU
    slidedp has one route (replicated, cpu): one point, route "auto"."""
    out: list[Spec] = []
    for w in args.world_sizes:
        tokens = set()
        if args.mode in ("strong", "both"):
            tokens.add(args.strong_tokens)
        if args.mode in ("weak", "both"):
            tokens.add(args.weak_tokens_per_rank * w)
        for t in sorted(tokens):
            for system in args.systems:
                routes = (args.routes if w > 1 else ["auto"]) if system == "slidedp" else [None]
                for route in routes:
                    spec = Spec(system, route, w, t)
                    if spec not in out:
                        out.append(spec)
    return out


def record_key(r: dict) -> tuple:
    return (r.get("shape"), r["system"], r.get("route"), r.get("world_size"), r["tokens_per_step"])


def merge_records(*lists: list[dict]) -> list[dict]:
    """Records of several runs: a point measured again replaces the earlier record of that point."""
    merged: dict[tuple, dict] = {}
    for records in lists:
        for r in records:
            merged.pop(record_key(r), None)
            merged[record_key(r)] = r
    return list(merged.values())


def point_args(spec: Spec, args, command: str, result: Path) -> dict:
    """What a point's process (and each FSDP2 rank's) needs: the namespace common.systems' Point reads,
    plus the point's route and world size."""
    return dict(
        system=spec.system, route=spec.route, world_size=spec.world_size, tokens=spec.tokens_per_step,
        modes=modes_of(args, spec.world_size, spec.tokens_per_step),
        shape=args.shape, seq=args.seq, device=args.device, budget=args.budget, steps=args.steps, seed=args.seed,
        precision=args.precision, hardware=args.hardware, plans_dir=args.plans_dir, reuse_plans=args.reuse_plans,
        cap_baselines=args.cap_baselines, baseline_micro_rows=args.baseline_micro_rows, no_warmup=args.no_warmup,
        max_grad_norm=args.max_grad_norm, nonfinite=args.nonfinite, baseline_checkpoint=args.baseline_checkpoint,
        baseline_compile=args.baseline_compile,
        plan=None, command=command, result_file=str(result), rank=0, init_method=None,
    )


def base_record(ns) -> dict:
    """Every required key, numbers null until measured."""
    r = single.base_record(ns.system, ns.tokens, ns)
    r.update(route=ns.route, world_size=ns.world_size, tokens_per_rank=ns.tokens // ns.world_size,
             modes=ns.modes, losses=None, hardware=None, git_commit=None)
    return r


# -- a point: one system, route, world size and tokens per step ---------------------------------------

class DoesNotFit(RuntimeError):
    """A point that cannot fit, found before running it; the record says why."""

    def __init__(self, text: str):
        super().__init__(text)
        self.record_text = text


class ScalingPoint(single.Point):
    """common.systems' Point over `world_size` ranks. slidedp: this process drives the engine's
    worker processes. FSDP2: this process is rank `rank`; rank 0 starts the others, waits for them
    and takes their peaks into its record."""

    def __init__(self, args):
        super().__init__(args)
        self.rank, self.world_size, self.init_method = args.rank, args.world_size, args.init_method
        self.fsdp2 = args.system.startswith("fsdp2")
        if self.rows % self.world_size:
            raise ValueError(f"{self.rows} rows of {self.seq} tokens do not split over {self.world_size} ranks")
        if self.fsdp2:  # this rank's share of every global batch
            share = self.rows // self.world_size
            self.data = [ids[self.rank * share:(self.rank + 1) * share] for ids in self.data]
            if self.cuda:
                self.dev = self.torch.device("cuda", self.rank)
            elif self.world_size > 1:
                self.torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        self.rank_procs: list[subprocess.Popen] = []
        self.rank_results: list[Path] = []
        self.rank_device_peaks: list | None = None
        self._ranks_lock, self._stopping = threading.Lock(), False

    def sync(self):
        super().sync()
        dist = self.torch.distributed
        if self.fsdp2 and self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    def run(self, system: str, sampler):
        W = self.world_size
        self.record.update(micro_batches=self.rows // W, micro_batches_per_rank=self.rows // W)
        try:
            if self.fsdp2:
                self.check_fits(system)
                if self.rank == 0 and W > 1:
                    self.start_ranks()
            super().run(system, sampler)
            if self.rank == 0:
                self.collect_ranks()
        finally:
            self.stop_ranks()
            self.host_record(sampler)

    # -- FSDP2 --
    def setup_fsdp2_gpu(self):
        return self.setup_fsdp2(offload=False)

    def check_fits(self, system: str):
        """fsdp2_gpu: refuse a point whose sharded training state alone exceeds a GPU (or the budget,
        with --cap-baselines, which also sets the cap)."""
        if not self.cuda:
            return
        import slidedp

        torch = self.torch
        total = torch.cuda.get_device_properties(self.dev).total_memory
        limit = total
        if self.args.cap_baselines:
            limit = min(total, slidedp.Budget.parse(self.args.budget).device_bytes)
            torch.cuda.set_per_process_memory_fraction(limit / total, self.dev)
            self.record["budget_bytes"] = limit
        self.record["device_limit_bytes"] = limit
        if system == "fsdp2_gpu":
            need = 16 * qwen3_params(self.args.shape) // self.world_size
            if need > limit:
                raise DoesNotFit(f"does not fit: {need / 2**30:.1f} GiB of fp32 weights, gradients and AdamW "
                                 f"moments per GPU (sharded over {self.world_size}) > {limit / 2**30:.1f} GiB")

    def start_ranks(self):
        """Rank 0: start ranks 1..W-1 (this script, --point, same spec) and a watchdog that ends this
        point as soon as one of them fails (the others would wait in a collective until the timeout)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        here = Path(self.args.result_file)
        for r in range(1, self.world_size):
            result = here.with_name(f"rank{r}.json")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--point", self.args.spec_path, "--rank", str(r),
                   "--init-method", self.init_method, "--result-file", str(result)]
            self.rank_results.append(result)
            self.rank_procs.append(subprocess.Popen(cmd))
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self):
        while self.rank_procs:
            for r, proc in enumerate(list(self.rank_procs), start=1):
                code = proc.poll()
                if code not in (None, 0):
                    self._rank_failed(r, code)
            time.sleep(0.5)

    def _rank_failed(self, r: int, code: int):
        """Rank r's process ended with an error: this point's record says so, and the point ends."""
        with self._ranks_lock:
            if self._stopping:  # rank 0 is stopping the ranks itself: its own record says why
                return
            error = f"rank {r} failed (exit code {code})"
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                error = f"rank {r}: " + json.loads(self.rank_results[r - 1].read_text())["error"]
            record = dict(self.record, error=error)
            for key in ("tokens_per_s", "measured_step_s", "peak_device_bytes", "peak_host_bytes"):
                record[key] = None
            Path(self.args.result_file).write_text(json.dumps(record, indent=1))
            print(f"=== {error}: ending the point", file=sys.stderr, flush=True)
            for proc in self.rank_procs:
                proc.kill()
            os._exit(1)

    def collect_ranks(self):
        """Rank 0, after its run: every rank's record; the largest device peak; a rank's error is the point's."""
        peaks = [self.record.get("peak_device_bytes")]
        for r, (proc, result) in enumerate(zip(self.rank_procs, self.rank_results), start=1):
            proc.wait(timeout=300)
            other = json.loads(result.read_text()) if result.exists() else {"error": f"exit code {proc.returncode}"}
            if other.get("error"):
                raise RuntimeError(f"rank {r}: {other['error']}")
            peaks.append(other.get("peak_device_bytes"))
        self.rank_procs = []
        if self.fsdp2 and self.cuda:
            self.rank_device_peaks = peaks

    def stop_ranks(self):
        with self._ranks_lock:
            self._stopping = True
            procs, self.rank_procs = self.rank_procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    # -- slidedp --
    def slidedp_hardware(self):
        return self.args.hardware or (None if self.cuda else cpu_hardware())

    def plan_path(self) -> Path:
        return plan_file(self.args, self.world_size, self.args.tokens, self.args.route)

    def slidedp_plan(self, model, budget, compile_blocks, kwargs):
        """A plan solved offline (--solve-plans) when --reuse-plans finds it; else solved here, with the
        route forced through SolverOptions (or the solver's choice, "auto")."""
        import slidedp

        path = self.plan_path()
        options = route_options(self.args.route)
        self.record["solver_options"] = None if options is None else {
            "deliveries": list(options.deliveries), "reductions": list(options.reductions)}
        compile_blocks = self.cuda if compile_blocks is None else compile_blocks
        if self.args.reuse_plans and path.exists():
            try:  # checked against this model and workload first: a plan compile would refuse is solved again
                slidedp.plan(model, budget, compile_blocks=compile_blocks, plan=str(path), **kwargs)
                return str(path)
            except (ValueError, KeyError, TypeError) as exc:
                self.record["plan_reuse_error"] = f"{type(exc).__name__}: {exc}"[:500]
        t0 = time.perf_counter()
        plan = slidedp.plan(model, budget, compile_blocks=compile_blocks, solver_options=options, **kwargs)
        self.record["plan_solve_s"] = time.perf_counter() - t0
        return plan

    def setup_slidedp(self, compile_blocks=None):
        step, finish, close = super().setup_slidedp(compile_blocks)
        plan = self.engine.plan
        streamed = [d for d in plan.decisions if d.layer_id not in plan.device_state]
        groups: dict[str, list[str]] = {}
        for d in streamed:
            route = f"{d.delivery}/{d.reduction}"
            if route not in groups.setdefault(d.kind, []):
                groups[d.kind].append(route)
        routes = sorted({f"{d.delivery}/{d.reduction}" for d in streamed})
        self.record.update(plan_routes=groups, route_planned=" + ".join(routes) if routes else "none (all on the GPUs)",
                           hardware_profile=plan.hardware.get("name"), plan_window=plan.window,
                           predicted=dict(plan.predicted))
        runner = self.engine.runner
        if not hasattr(runner, "device_memory"):  # one rank, in this process: Point.run measures it
            return step, finish, close
        runner.device_memory(reset=True)  # the build's peaks are not the step's, as in one process

        def close_all():
            try:
                if self.record.get("measured_step_s") is not None:  # each worker's peak (None on the CPU)
                    self.rank_device_peaks = [p and p["max_allocated_bytes"] for p in runner.device_memory()]
            finally:
                close()

        return step, finish, close_all

    # -- the record --
    def host_record(self, sampler):
        if self.rank_device_peaks is not None:
            self.record.update(peak_device_bytes_per_rank=self.rank_device_peaks,
                               peak_device_bytes=max((p for p in self.rank_device_peaks if p is not None), default=None))
        if not isinstance(sampler, TreeSampler):
            return
        sampler.sample()
        self.record["vm_hwm_rank0_bytes"] = self.record.get("peak_host_bytes")  # this process's VmHWM
        self.record.update(peak_host_bytes=sampler.pss_peak_window or None,
                           peak_host_bytes_incl_build=sampler.pss_peak_all or None,
                           host_pss_bytes_per_process=sorted(sampler.pss_at_window_peak.values(), reverse=True))


def point_main(args) -> int:
    """A point's process (rank 0), or one FSDP2 rank's (--rank > 0)."""
    ns = argparse.Namespace(**json.loads(Path(args.point).read_text()))
    ns.spec_path = args.point
    if args.rank:
        ns.rank, ns.init_method, ns.result_file = args.rank, args.init_method, args.result_file
    if ns.device == "cuda" and ns.system.startswith("fsdp2"):
        import torch

        torch.cuda.set_device(ns.rank)  # before anything touches CUDA: no context on another rank's GPU
    sampler = TreeSampler() if ns.rank == 0 else single.HostMemSampler()
    record = base_record(ns)
    record["env"] = {key: os.environ.get(key) for key in RUN_ENV}
    return single.worker(ns, record, point_cls=ScalingPoint, sampler=sampler)


# -- the driver -------------------------------------------------------------------------------------------

def gpu_count(device: str) -> int | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.device_count()


def host_bytes_needed(system: str, shape: str, world_size: int, device: str) -> int:
    """Host memory a point needs, roughly: 16 bytes per parameter of training state where it lives on
    the host (slidedp's host state; FSDP2's offloaded fp32 weights, gradients and AdamW moments),
    the model built once per rank on a CPU device, and an allowance per process."""
    params = qwen3_params(shape)
    processes = world_size + (1 if system == "slidedp" and world_size > 1 else 0)
    need = processes * PROCESS_HOST_BYTES[device]
    if system != "fsdp2_gpu" or device == "cpu":
        need += 16 * params
    if system.startswith("fsdp2") and device == "cpu":
        need += 4 * params * world_size
    return need


def preflight(spec: Spec, args, gpus: int | None) -> str | None:
    """Why the point cannot run here (None: it can)."""
    seq = seq_of(args)
    if spec.tokens_per_step % (spec.world_size * seq):
        return (f"{spec.tokens_per_step} tokens per step do not split into whole sequences of {seq} tokens "
                f"over {spec.world_size} GPU(s)")
    if gpus is not None and spec.world_size > gpus:
        return f"needs {spec.world_size} GPUs, this machine has {gpus}"
    need = host_bytes_needed(spec.system, args.shape, spec.world_size, args.device)
    if args.host_ram_bytes is not None:
        available, source = args.host_ram_bytes, "--host-ram"
    else:
        from slidedp.run.preflight import host_available_bytes

        available, source = host_available_bytes(), "available (MemAvailable, cgroup)"
    if available is not None and need > available:
        return (f"not enough host RAM: the point needs about {need / 2**30:.1f} GiB, {source} "
                f"{available / 2**30:.1f} GiB (where /proc/meminfo under-reports the RAM, give it with --host-ram)")
    return None


def run_spec(spec: Spec, args, command: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="multi_gpu_scaling_") as tmp:
        result = Path(tmp) / "record.json"
        spec_path = Path(tmp) / "point.json"
        ns = point_args(spec, args, command, result)
        spec_path.write_text(json.dumps(ns))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--point", str(spec_path)]
        print(f"\n=== {spec.title()} ===", file=sys.stderr, flush=True)
        return run_child(cmd, result, args.timeout_s, base_record(argparse.Namespace(**ns)))


def hardware_text(record: dict, host: dict) -> str:
    device = record.get("device_name") or ("CPU processes" if record.get("device") == "cpu" else "?")
    ranks = record.get("world_size") or 1
    return (f"{ranks} x {device}; host {host.get('host_cpu')}, {host.get('host_cores')} cores, "
            f"{_gib(host.get('host_mem_bytes'))} GiB RAM")


def drive(args) -> int:
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the child goes with us
    for key, value in RUN_ENV.items():
        os.environ.setdefault(key, value)
    out = Path(args.out)
    records: list[dict] = json.loads(out.read_text()) if args.merge and out.exists() else []
    host = host_description()
    extra = {**commit_stamp(args.allow_dirty), **host}
    gpus = gpu_count(args.device)
    for spec in points(args):
        why = preflight(spec, args, gpus)
        if why is None:
            record = run_spec(spec, args, command)
        else:
            ns = argparse.Namespace(**point_args(spec, args, command, Path(os.devnull)))
            record = dict(base_record(ns), error=why)
        record.update({k: v for k, v in extra.items() if record.get(k) is None})
        record["hardware"] = hardware_text(record, host)
        records = merge_records(records, [record])
        write_records(out, records)
        summary = record["error"] or (f"{record['tokens_per_s']:.0f} tokens/s, {record['measured_step_s']:.3f} s/step "
                                      f"(predicted {_num(record.get('predicted_step_s'), '.3f')}), "
                                      f"losses {record.get('losses')}")
        print(f"=== {spec.title()}: {summary}", file=sys.stderr, flush=True)
    print(render_table(records))
    print(render_targets(records))
    if args.readme:
        update_readme(Path(args.readme_path), render_section(records, out), README_BEGIN, README_END)
    return 0


# -- offline planning ---------------------------------------------------------------------------------

def solve_plans(args) -> int:
    """Solve and save slidedp's plan of every point of the run (meta-device model, no GPU, no weights),
    for --hardware (default h200-sxm), where the measuring run with --reuse-plans looks for them."""
    import torch

    import slidedp

    precision = default_precision(args)
    seq = seq_of(args)
    model = _model.empty_model(args.shape, dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                               device="cpu")
    hardware = args.hardware or ("h200-sxm" if args.device == "cuda" else cpu_hardware())
    failed = 0
    for spec in points(args):
        if spec.system != "slidedp":
            continue
        path = plan_file(args, spec.world_size, spec.tokens_per_step, spec.route)
        t0 = time.perf_counter()
        try:
            if spec.tokens_per_step % (spec.world_size * seq):
                raise ValueError(f"{spec.tokens_per_step} tokens do not split over {spec.world_size} x {seq}")
            plan = slidedp.plan(model, args.budget, batch_size=1, seq_len=seq, world_size=spec.world_size,
                                micro_batches=spec.tokens_per_rank // seq, precision=precision, hardware=hardware,
                                compile_blocks=args.device == "cuda", solver_options=route_options(spec.route),
                                optimizer=slidedp.AdamW(lr=_model.LR, betas=_model.BETAS, eps=_model.EPS,
                                                        weight_decay=_model.WEIGHT_DECAY),
                                max_grad_norm=args.max_grad_norm, nonfinite=args.nonfinite)
        except Exception as exc:  # noqa: BLE001 - one plan that cannot be made does not stop the others
            failed += 1
            print(f"{path.name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        print(f"{path}: predicted {plan.predicted_step_time_s:.3f} s/step, peak "
              f"{plan.peak_device_bytes / 2**30:.1f} GiB, solved in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


# -- rendering --------------------------------------------------------------------------------------------

def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "–"


class Index:
    """Records by point, and the bases the derived columns compare with."""

    def __init__(self, records: list[dict]):
        self.by = {record_key(r): r for r in records}

    def one_gpu(self, r: dict, tokens: int) -> dict | None:
        """The same shape and system on one GPU at `tokens` per step (slidedp: the same route, else
        "auto", the one route there is with one GPU)."""
        for route in dict.fromkeys((r.get("route"), "auto" if r["system"] == "slidedp" else None)):
            base = self.by.get((r.get("shape"), r["system"], route, 1, tokens))
            if base and not base.get("error"):
                return base
        return None

    def efficiency(self, r: dict, tokens: int) -> float | None:
        base = self.one_gpu(r, tokens)
        tps, w = r.get("tokens_per_s"), r.get("world_size") or 1
        return tps / (w * base["tokens_per_s"]) if tps and base and base.get("tokens_per_s") else None

    def strong(self, r: dict) -> float | None:
        return self.efficiency(r, r["tokens_per_step"])

    def weak(self, r: dict) -> float | None:
        return self.efficiency(r, r["tokens_per_rank"])

    def vs_offload(self, r: dict) -> float | None:
        base = self.by.get((r.get("shape"), "fsdp2_cpu_offload", None, r.get("world_size"), r["tokens_per_step"]))
        tps = r.get("tokens_per_s")
        return tps / base["tokens_per_s"] if tps and base and base.get("tokens_per_s") else None

    def host_growth(self, r: dict) -> float | None:
        """Peak host bytes over one GPU's at the same tokens per GPU (else the same tokens per step)."""
        base = self.one_gpu(r, r["tokens_per_rank"]) or self.one_gpu(r, r["tokens_per_step"])
        host = r.get("peak_host_bytes")
        return host / base["peak_host_bytes"] if host and base and base.get("peak_host_bytes") else None


def _route_cell(r: dict) -> str:
    if r["system"] != "slidedp":
        return "–"
    planned = r.get("route_planned")
    if r.get("route") in (None, "auto"):
        return f"auto ({planned})" if planned else "auto"
    return r["route"] if planned in (None, r["route"]) else f"{r['route']} ({planned})"


def render_table(records: list[dict]) -> str:
    """Markdown table: one row per point, by shape, system, route, tokens per step and GPUs."""
    idx = Index(records)
    sys_order = {s: i for i, s in enumerate(SYSTEMS)}
    route_order = {s: i for i, s in enumerate(ROUTES)}
    rows = sorted(records, key=lambda r: (str(r.get("shape")), sys_order.get(r["system"], 99), r["system"],
                                          route_order.get(r.get("route"), -1), r["tokens_per_step"],
                                          r.get("world_size") or 1))
    head = ["shape", "system", "route", "GPUs", "tokens/step", "tokens/GPU", "tokens/s", "strong eff.", "weak eff.",
            "vs FSDP2 offload", "peak device GiB (max rank)", "peak host GiB (PSS, all processes)", "host vs 1 GPU",
            "step s median / predicted", "measured / predicted", "loss step 1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tps = r.get("tokens_per_s")
        step_s, mark = step_figure(r)
        speed = r["error"].splitlines()[0][:100] if r.get("error") else _num(tps, ",.0f") + mark
        losses = r.get("losses") or []
        vs = idx.vs_offload(r)
        cells = [str(r.get("shape")), NAMES.get(r["system"], r["system"]), _route_cell(r), str(r.get("world_size")),
                 f"{r['tokens_per_step']:,}", f"{r['tokens_per_rank']:,}", speed,
                 _num(idx.strong(r), ".0%"), _num(idx.weak(r), ".0%"), "–" if vs is None else f"{vs:.2f}x",
                 _gib(r.get("peak_device_bytes")), _gib(r.get("peak_host_bytes")), _num(idx.host_growth(r), ".2f"),
                 f"{_num(step_s, '.3f')}{mark if step_s is not None else ''} / {_num(r.get('predicted_step_s'), '.3f')}",
                 _ratio(step_s, r.get("predicted_step_s")),
                 _num(losses[0] if losses else None, ".5f")]
        lines.append("| " + " | ".join(cells) + " |")
    note = marks_note(rows)
    return "\n".join(lines) + (f"\n\n{note}." if note else "")


def render_targets(records: list[dict]) -> str:
    """The issue's targets against slidedp's records, one line each: every route's value, met or not."""
    idx = Index(records)
    slide = [r for r in records if r["system"] == "slidedp" and not r.get("error") and r.get("tokens_per_s")]
    series: dict[tuple, list[dict]] = {}
    for r in slide:
        series.setdefault((r.get("shape"), r.get("route")), []).append(r)

    def label(key):
        return f"{key[0]} {key[1]}"

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    lines = []
    strong = []
    for r in sorted(slide, key=lambda r: (str(r.get("shape")), str(r.get("route")), r["tokens_per_step"])):
        e = idx.strong(r) if r.get("world_size") == STRONG_WORLD_SIZE else None
        if e is not None:
            strong.append(f"{label((r.get('shape'), r.get('route')))} at {r['tokens_per_step']:,} tokens/step "
                          f"{e:.0%} {verdict(e >= STRONG_EFFICIENCY_MIN)}")
    lines.append(f"- strong-scaling efficiency from 1 to {STRONG_WORLD_SIZE} GPUs >= {STRONG_EFFICIENCY_MIN:.0%}: "
                 + ("; ".join(strong) or "not measured"))
    vs, host, pred = [], [], []
    for key, rs in sorted(series.items(), key=lambda kv: str(kv[0])):
        ratios = [(idx.vs_offload(r), r) for r in rs if idx.vs_offload(r) is not None]
        if ratios:
            low, r = min(ratios, key=lambda t: t[0])
            vs.append(f"{label(key)} lowest {low:.2f}x ({r['world_size']} GPUs, {r['tokens_per_step']:,} tokens) "
                      f"{verdict(low >= VS_OFFLOAD_MIN)}")
        growth = [g for g in (idx.host_growth(r) for r in rs if (r.get("world_size") or 1) > 1) if g is not None]
        if growth:
            host.append(f"{label(key)} at most {max(growth):.2f}x {verdict(max(growth) <= 1 + HOST_FLAT_TOLERANCE)}")
        errs = [step_figure(r)[0] / r["predicted_step_s"] - 1 for r in rs
                if r.get("predicted_step_s") and step_figure(r)[0]]
        if errs:
            worst = max(errs, key=abs)
            pred.append(f"{label(key)} worst {worst:+.0%} {verdict(abs(worst) <= PREDICTION_TOLERANCE)}")
    lines.append(f"- >= {VS_OFFLOAD_MIN}x FSDP2 with CPU offload at every point: " + ("; ".join(vs) or "not measured"))
    lines.append(f"- host memory flat in the number of GPUs (at most {HOST_FLAT_TOLERANCE:.0%} above 1 GPU's): "
                 + ("; ".join(host) or "not measured"))
    lines.append(f"- predicted step time within {PREDICTION_TOLERANCE:.0%} of measured (measured / predicted - 1): "
                 + ("; ".join(pred) or "not measured"))
    return "\n".join(lines)


def render_section(records: list[dict], out_path: Path | str | None = None) -> str:
    """The README section: title, commands, hardware, table, targets, how it was measured."""
    dates = sorted({r["date"] for r in records if r.get("date")})
    commands = sorted({r["command"] for r in records if r.get("command")})
    # a point that failed may not have seen its GPUs
    hardware = sorted({r["hardware"] for r in records if r.get("hardware") and not r.get("error")})
    soft = sorted({f"torch {r['torch']}, transformers {r['transformers']}" for r in records if r.get("torch")})
    commits = sorted({r["git_commit"] for r in records if r.get("git_commit")})
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes") and r["system"] == "slidedp"})
    shapes = sorted({str(r.get("shape")) for r in records})
    profiles = sorted({r["hardware_profile"] for r in records if r.get("hardware_profile")})
    rel = None
    if out_path is not None:
        with contextlib.suppress(ValueError):
            rel = Path(out_path).resolve().relative_to(HERE)
    lines = [f"## Multi-GPU scaling, slidedp against FSDP2 ({', '.join(dates) or 'not run'})", ""]
    lines += [f"`{c}`" for c in commands]
    lines += ["", f"(records: `{rel or (Path(out_path).name if out_path else 'results/')}`; plans: "
                  "`plans/` beside the records unless `--plans-dir` said otherwise; regenerate them with "
                  "`--solve-plans`)", ""]
    lines.append(f"Hardware: {'; '.join(hardware) or '?'}; {'; '.join(soft)}"
                 + (f"; commit {', '.join(commits)}" if commits else "") + ".")
    lines.append(f"Model: Qwen3 shape {', '.join(f'`{s}`' for s in shapes)} "
                 f"({', '.join(f'{qwen3_params(s):,}' for s in shapes if s in _model.SHAPES)} parameters), untied, "
                 f"random init; slidedp budget {', '.join(_gib(b) + ' GiB' for b in budgets) or '–'} per GPU; "
                 f"plans for {', '.join(profiles) or '–'}.")
    lines += ["", render_table(records), "", "Targets (issue 8):", "", render_targets(records)]
    notes = (
        "Same model, batches and optimizer in every system and for every number of GPUs (the global batch of a "
        "step is split over the ranks by rows), so the step-1 losses agree. Strong efficiency = tokens/s over "
        "(GPUs x tokens/s on one GPU) at the same tokens per step; weak efficiency the same at the same tokens per "
        "GPU; slidedp's one-GPU point (one route there) is the base of every route. Route: what the plan has for "
        "the layers that stream (auto: the solver's choice; a forced route through SolverOptions). Peak device: "
        "torch.cuda.max_memory_allocated after the build, the busiest rank. Peak host: summed PSS of every process "
        "of the point (shared host state counted once), sampled every second; host vs 1 GPU at the same tokens "
        "per GPU. FSDP2: fully_shard per block and on the root over all GPUs, bf16 parameters and fp32 reduction, "
        "activation checkpointing, fused AdamW; CPU offload with pinned memory. Each point ran in its own "
        "processes, one after the other; 1 warm-up step, then the timed steps. Tokens/s and step time: the median "
        "over the steady steps, the timed steps but the first (no earlier CPU update to wait for) and the last "
        "(the final flush)."
    )
    lines += ["", textwrap.fill(notes, width=100, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--world-sizes", type=int, nargs="+",
                   help="GPUs (ranks) per point (default: 1 2 4, and 8 with 8 GPUs; on the CPU 1 2)")
    p.add_argument("--mode", choices=["strong", "weak", "both"], default="both")
    p.add_argument("--strong-tokens", type=int, help="strong scaling: tokens per step (default 16 sequences: 65,536)")
    p.add_argument("--weak-tokens-per-rank", type=int,
                   help="weak scaling: tokens per GPU per step (default 4 sequences: 16,384)")
    p.add_argument("--budget", default="40GiB", help="slidedp's device-memory budget per GPU")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES),
                   help="slidedp's routes with several GPUs: delivery/reduction forced, or auto (the solver's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda, or cpu (smoke test: gloo)")
    p.add_argument("--out", help="records (default: results/<today>-qwen3-<shape>.json in this folder; with --render: where the "
                                  "merged records go, none by default)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per point")
    p.add_argument("--plans-dir", help="slidedp's plans (default: plans/ beside --out)")
    p.add_argument("--reuse-plans", action="store_true", help="use the plans --solve-plans saved in --plans-dir")
    p.add_argument("--solve-plans", action="store_true", help="only solve and save slidedp's plans (no GPU)")
    p.add_argument("--hardware", help="slidedp hardware preset or profile (default: detected; --solve-plans: "
                                      "h200-sxm)")
    p.add_argument("--cap-baselines", action="store_true", help="hold FSDP2 to --budget per GPU")
    p.add_argument("--host-ram", help="host RAM for the preflight, e.g. 500GiB, where /proc/meminfo under-reports "
                                      "it; also skips slidedp's own host check (SLIDEDP_SKIP_PREFLIGHT=1)")
    add_record_args(p, readme_path=str(HERE / "README.md"))
    p.add_argument("--render", metavar="JSON", nargs="+",
                   help="only render records files, merged (a later file's point replaces an earlier one's)")
    # a point's process (internal)
    p.add_argument("--point", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.point:
        return point_main(args)
    if args.render:
        records = merge_records(*(json.loads(Path(f).read_text()) for f in args.render))
        if args.out:
            write_records(Path(args.out), records)
        print(render_table(records))
        print(render_targets(records))
        if args.readme:
            update_readme(Path(args.readme_path), render_section(records, args.out or args.render[0]),
                          README_BEGIN, README_END)
        return 0
    args.out = args.out or str(HERE / "results" / f"{datetime.date.today().isoformat()}-qwen3-{args.shape}.json")
    seq = seq_of(args)
    args.strong_tokens = args.strong_tokens or 16 * seq
    args.weak_tokens_per_rank = args.weak_tokens_per_rank or 4 * seq
    if args.world_sizes is None:
        gpus = gpu_count(args.device) if not args.solve_plans else None
        args.world_sizes = [1, 2] if args.device == "cpu" else [1, 2, 4] + ([8] if (gpus or 0) >= 8 else [])
    if args.steps < 1 or args.baseline_micro_rows < 1 or min(args.world_sizes) < 1 or \
            min(args.strong_tokens, args.weak_tokens_per_rank) < 1:
        p.error("--steps, --baseline-micro-rows, --world-sizes and the tokens must be positive")
    if args.plans_dir is None:
        args.plans_dir = str(Path(args.out).resolve().parent / "plans")
    args.host_ram_bytes = None
    if args.host_ram:
        import slidedp

        args.host_ram_bytes = slidedp.Budget.parse(args.host_ram).device_bytes
        os.environ["SLIDEDP_SKIP_PREFLIGHT"] = "1"
    if args.solve_plans:
        return solve_plans(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
