"""Every system in the same run, on the same random-init model and the same batches: slidedp against
GPU-resident PyTorch, FSDP2 with CPU offload and DeepSpeed ZeRO-Offload (ZeRO-2 and ZeRO-3, CPU Adam),
Qwen3-4B shape, seq 4096, one H200.

    python benchmarks/single_gpu_throughput/run.py --tokens 4096 16384 32768 \
        --systems slidedp gpu_resident fsdp2_cpu_offload --budget 40GiB --steps 3 --readme
    python benchmarks/single_gpu_throughput/run.py --render RECORDS.json --readme  # table only
    python benchmarks/single_gpu_throughput/run.py --solve-plans --hardware h200-sxm \
        --tokens 4096 16384 32768 --budget 40GiB  # pre-solve slidedp's plans where OR-Tools is installed
        # (no GPU needed; into plans/ beside --out); then
    python benchmarks/single_gpu_throughput/run.py ... --plan 'benchmarks/single_gpu_throughput/results/plans/qwen3_4b_{tokens}.json'
    python benchmarks/single_gpu_throughput/run.py --shape tiny --device cpu --tokens 64 --out /tmp/x.json  # CPU smoke

Records go to results/<date>-qwen3-<shape>.json in this folder unless --out says otherwise; each
holds the commit it ran on ("git_commit"), and a working tree with uncommitted changes is refused
unless --allow-dirty (the records then say "dirty": true). The model, the systems and the
measurement are in benchmarks/common/ (model.py, systems.py), shared with multi_gpu_scaling.

The driver runs each (system, tokens) point in a fresh child process of this script (`--worker`), one
at a time: three 4.4 B-parameter training states do not fit in host RAM together, and a point that
crashes, runs out of memory or is killed becomes a record with an "error" and null numbers instead
of ending the run. The JSON list is rewritten after every point, so a killed run keeps what it has.

Same model, same batches. Every child builds the model on the meta device and then gives each
parameter its initial value from its own seeded generator (seed and parameter name), on the run's
device (CUDA on the GPU run, so 4.4 B values take well under a second): normal(0, 0.02) for
matrices, ones for the RMSNorm weights. The values are rounded to bf16, so fp32 copies (the
GPU-resident model, FSDP2's sharded parameters, slidedp's fp32 master) and bf16 copies (the model
handed to slidedp) hold bit-identical initial weights in every system. The batches are uniform
random token ids from a generator seeded per step. The rotary-embedding buffers are recomputed in
fp32 (they are not parameters and stay fp32 in every system). Warm-up step = step 1 of training, on
the same batch everywhere, so the first losses must agree to bf16 tolerance.

Systems (AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0, global gradient-norm clipping
to 1.0, loss = token-weighted mean next-token cross-entropy over the whole step, gradient
accumulation over micro-batches of 1 x seq rows):

* slidedp: `slidedp.compile(model, budget, batch_size=1, seq_len=seq, precision="bf16",
  micro_batches=tokens // seq, ...)`. The model is built in bf16 on the CPU: compile copies the
  weights into its host state and then makes the model's parameters views of that state, so a bf16
  model halves the temporary copy (8.8 GB instead of 17.6 GB for 4.4 B parameters) and loses nothing,
  the initial weights being bf16 values. The plan is saved beside the output
  (`plans/qwen3_<shape>_<tokens>.json` beside --out), its summary goes into the record.
* gpu_resident: plain PyTorch at its best configuration that fits: fp32 parameters on the GPU,
  `torch.autocast("cuda", bf16)`, `torch.optim.AdamW(fused=True)` on the GPU, every decoder block
  compiled (`torch.compile`, `--baseline-compile`), and non-reentrant activation checkpointing on the
  fewest leading blocks that fit (`--baseline-checkpoint auto`: a binary search, each try one forward
  and backward of the first batch with the optimizer state allocated; the record names the blocks and
  the tries). Its peak device memory is in the record beside slidedp's.
* fsdp2_cpu_offload: one process, world size 1 (NCCL, plus gloo for CPU tensors), `fully_shard` on
  every decoder layer and then on the root with `CPUOffloadPolicy(pin_memory=True)` and
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `torch.optim.AdamW(fused=True)` on
  the CPU-resident DTensor parameters (if this torch cannot, the record's "optimizer" says so and
  names the for-loop AdamW used instead), activation checkpointing of every block.
* deepspeed_zero2_offload, deepspeed_zero3_offload, deepspeed_zero3_offload_param: DeepSpeed (optional:
  `pip install -e '.[deepspeed]'`; benchmarks/common/deepspeed_wheels.sh prepares the wheels for a machine
  without network) in this one process, no launcher: `deepspeed.init_distributed` on a free local port
  (NCCL, world size 1), then `deepspeed.initialize` with the config of
  `benchmarks/common/deepspeed_zero.py: zero_offload_config`: ZeRO stage 2 or 3, bf16,
  `offload_optimizer: {device: cpu, pin_memory: true}` (DeepSpeedCPUAdam in AdamW mode, fp32 master and
  moments on the CPU; its C++ op JIT-built before the build timer stops, its seconds in
  "cpu_adam_build_s"), overlap_comm, contiguous gradients, 5e8-element buckets (ZeRO-2) or Hugging
  Face's hidden^2-based sizes (ZeRO-3), and for `_param` the parameters offloaded to pinned CPU memory
  too; DeepSpeed's own gradient clipping and gradient accumulation (one engine.step per micro-batch, the
  update at the last). Activation checkpointing on the fewest leading blocks that fit
  (`--deepspeed-checkpoint auto`: probed on the bare bf16 model before deepspeed.initialize, whose whole
  gradient on the device is more than ZeRO's buckets), or `all`, `none`, a number. Blocks are not
  compiled. A DeepSpeed that is missing, or whose op does not build, becomes the point's "error" (the
  compiler's output included), and the run goes on.

On `--device cpu` (the smoke path for tests) slidedp runs in fp32, gpu_resident is the same model
and loop on the CPU without autocast and with plain AdamW (`fused=False`), and FSDP2 runs on a gloo
process group with `CPUOffloadPolicy(pin_memory=False)`.

Measured per point: 1 warm-up step, then `--steps` timed steps between two device synchronisations
(slidedp's asynchronous CPU update of the warm-up step is waited for before the timed region, that of
the last timed step inside it, so the region holds exactly `--steps` steps and updates);
measured_step_s is their mean. The first timed step is short (no earlier update to wait for) and the
last includes the final flush, so the figures reported are over the steady steps, the timed steps but
the first and the last (benchmarks/common/steady.py; the record's "steady_rule" says which):
median_step_s, mean_step_s, steady_steps, tokens_per_s = tokens_per_step / median_step_s. A point with
fewer than 10 steady steps says "few_steps": true and is marked in the table (default --steps 12).
peak_device_bytes is `torch.cuda.max_memory_allocated()` from after the build to the end, and
peak_device_reserved_bytes `torch.cuda.max_memory_reserved()` (the caching allocator's pages, which a
budget does not bound yet); the table shows both. Each is the larger of the warm-up's peak
(warmup_peak_device_*: first compilations) and the timed steps' (steps_peak_device_*: measured after
the warm-up's cached pages are released).
peak_host_bytes is the process's peak resident set size (VmHWM) over the same window: the counter is
reset after the build by writing 5 to /proc/self/clear_refs (the build's transient copies are in
peak_host_bytes_incl_build). VmHWM counts shared memory that the process has touched: slidedp's
host state is a memfd shared segment, and its pages count as RssShmem. Pinned buffers allocated by
the CUDA driver (cudaHostAlloc: FSDP2's pinned parameters and gradients, torch's pinned-memory
cache) are mapped by the driver and may not be counted in RSS at all, so host_used_bytes is also
recorded: the peak, over the window, of the whole machine's used memory (MemTotal - MemAvailable,
sampled every 50 ms) above its value when the child started, which counts every kind of page.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE.parents[1]) not in sys.path:  # run as a script: the repository root, for `benchmarks.common`
    sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.common import systems  # noqa: E402
from benchmarks.common.child import run_child  # noqa: E402,F401 - part of this harness's interface
from benchmarks.common.cli import add_model_args, add_record_args, checkpoint_choice  # noqa: E402
from benchmarks.common.deepspeed_zero import NAMES as DEEPSPEED_NAMES, SYSTEMS as DEEPSPEED_SYSTEMS  # noqa: E402
from benchmarks.common.fit_set import card_of  # noqa: E402
from benchmarks.common.hostmem import HostMemSampler  # noqa: E402,F401 - re-exported
from benchmarks.common.model import (BETAS, EPS, LR, MAX_GRAD_NORM, SHAPES, WEIGHT_DECAY, empty_model,  # noqa: E402,F401
                                     plan_graph_of, qwen3_config)
from benchmarks.common.records import commit_stamp, host_description, write_records  # noqa: E402
from benchmarks.common.steady import marks_note, step_figure  # noqa: E402
from benchmarks.common.systems import Point, base_record, error_text  # noqa: E402,F401 - re-exported
from benchmarks.common.tables import gib as _gib, num as _num, update_readme as _update_readme  # noqa: E402
SYSTEMS = ("slidedp", "slidedp_eager", "gpu_resident", "fsdp2_cpu_offload", *DEEPSPEED_SYSTEMS)
BASELINES = ("gpu_resident", "fsdp2_cpu_offload")
REQUIRED_KEYS = ("system", "tokens_per_step", "tokens_per_s", "peak_device_bytes", "peak_host_bytes",
                 "measured_step_s", "predicted_step_s", "budget_bytes", "date", "command")
README_BEGIN = "<!-- single_gpu_throughput:begin -->"
README_END = "<!-- single_gpu_throughput:end -->"


def worker(args, point_cls=None, sampler=None, record=None) -> int:
    """One point in this process (a `point_cls`, default Point); its record goes to --result-file."""
    record = base_record(args.system, args.tokens, args) if record is None else record
    return systems.worker(args, record, point_cls=point_cls, sampler=sampler)


# -- the driver -------------------------------------------------------------------------------------------

def run_point(system: str, tokens: int, args, command: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="single_gpu_throughput_") as tmp:
        result = Path(tmp) / "record.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--system", system, "--tokens", str(tokens),
               "--shape", args.shape, "--device", args.device, "--budget", args.budget, "--steps", str(args.steps),
               "--seed", str(args.seed), "--plans-dir", args.plans_dir, "--result-file", str(result),
               "--command", command, "--baseline-micro-rows", str(args.baseline_micro_rows),
               "--slidedp-micro-rows", str(args.slidedp_micro_rows), "--max-grad-norm", str(args.max_grad_norm),
               "--nonfinite", args.nonfinite, "--deepspeed-checkpoint", args.deepspeed_checkpoint,
               "--baseline-checkpoint", args.baseline_checkpoint]
        if args.baseline_compile is not None:
            cmd.append("--baseline-compile" if args.baseline_compile else "--no-baseline-compile")
        for opt in ("plan", "hardware", "precision", "seq", "host_profile"):
            if getattr(args, opt):
                cmd += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
        if args.no_warmup:
            cmd.append("--no-warmup")
        rows = "" if system.startswith("slidedp") else f", {args.baseline_micro_rows}-row micro-batches"
        print(f"\n=== {system}, {tokens} tokens/step{rows} ===", file=sys.stderr, flush=True)
        fallback = base_record(system, tokens, args)
        fallback["command"] = command
        return run_child(cmd, result, args.timeout_s, fallback)


# The record fields that say which configuration a point measured (a missing shape is the default, 4b).
POINT_FIELDS = ("system", "shape", "tokens_per_step", "seq_len", "budget_bytes", "max_grad_norm", "nonfinite",
                "slidedp_micro_rows", "baseline_micro_rows", "checkpoint_setting", "device_name", "git_commit",
                "plan_sha256")


def _point(record: dict) -> tuple:
    """What a record measured: a rerun of the same configuration on the same card and commit replaces it
    in a --merge; any other point (another shape, budget, clipping, micro-batching, card, commit or plan:
    an A/B twin) is kept beside it."""
    return tuple(record.get(k, "4b" if k == "shape" else None) for k in POINT_FIELDS)


def drive(args) -> int:
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    # A SIGTERM to the driver becomes an exception, so that the running child is killed with it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.out)
    records: list[dict] = []
    if args.merge and out.exists():
        records = json.loads(out.read_text())
    extra = {**commit_stamp(args.allow_dirty), **host_description()}
    deadline = None if args.time_left_s is None else time.monotonic() + args.time_left_s
    timeout_s = args.timeout_s
    micro_rows = args.baseline_micro_rows
    points = [(tokens, system, rows) for tokens in args.tokens for system in args.systems
              for rows in (micro_rows[:1] if system.startswith("slidedp") else micro_rows)]
    for tokens, system, rows in points:
        args.baseline_micro_rows = rows  # the point's own (slidedp's points ignore it)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < MIN_POINT_S:
                print(f"=== {system}, {tokens} tokens/step: not run, {left:.0f} s left", file=sys.stderr, flush=True)
                continue
            args.timeout_s = min(timeout_s, left - 5)
        record = run_point(system, tokens, args, command)
        record.update({k: v for k, v in extra.items() if k not in record})
        records = [r for r in records if _point(r) != _point(record)] + [record]
        write_records(out, records)
        summary = record["error"] or (f"{record['tokens_per_s']:.0f} tokens/s, "
                                      f"{record['measured_step_s']:.3f} s/step, losses {record.get('losses')}")
        print(f"=== {system}, {tokens} tokens/step: {summary}", file=sys.stderr, flush=True)
    print(render_table(records))
    if args.readme:
        update_readme(Path(args.readme_path), render_section(records, out))
    return 0


# -- rendering -------------------------------------------------------------------------------------------

NAMES = {"slidedp": "slidedp", "slidedp_eager": "slidedp, eager blocks", "gpu_resident": "GPU-resident",
         "fsdp2_cpu_offload": "FSDP2 + CPU offload", **DEEPSPEED_NAMES}


def render_table(records: list[dict]) -> str:
    """Markdown table of the records: one row per point, ratios against each baseline's fastest point of
    the same shape, tokens per step and clipping (records without max_grad_norm clipped at 1.0; without
    shape: 4b). A shape column when the records hold several shapes."""
    order = {s: i for i, s in enumerate(SYSTEMS)}

    def clip(r):
        return r.get("max_grad_norm", 1.0)

    def shape(r):
        return r.get("shape", "4b")

    several = len({shape(r) for r in records}) > 1
    rows = sorted(records, key=lambda r: (shape(r), r["tokens_per_step"], clip(r) is None, order.get(r["system"], 99),
                                          r["system"], r.get("budget_bytes") or 0))
    # a baseline's ratio is against its fastest point (of the same shape, tokens and clipping): its best
    # configuration among those run (e.g. one micro-batch of every row against several of one)
    by_point: dict[tuple, dict] = {}
    for r in records:
        key = (shape(r), r["tokens_per_step"], r["system"], clip(r))
        if (r.get("tokens_per_s") or 0) >= (by_point.get(key, {}).get("tokens_per_s") or 0):
            by_point[key] = r
    # the two baselines always, each DeepSpeed system where the records hold it
    baselines = [*BASELINES, *(s for s in DEEPSPEED_NAMES if any(r["system"] == s for r in records))]
    head = ["shape"] * several + ["tokens/step", "system", "budget GiB", "tokens/s"] + [
        f"vs {NAMES[b]}" for b in baselines] + [
        "peak device GiB allocated / reserved", "peak host GiB (VmHWM, steps / incl. build)", "host used GiB", "step s median / predicted", "loss step 1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tps = r.get("tokens_per_s")
        ratios = []
        for b in baselines:
            base = by_point.get((shape(r), r["tokens_per_step"], b, clip(r)), {}).get("tokens_per_s")
            ratios.append(f"{tps / base:.2f}x" if tps and base else "–")
        figure, mark = step_figure(r)
        if r.get("error"):
            speed = r["error"].splitlines()[0][:80]
        else:
            speed = _num(tps, ",.0f") + mark
        losses = r.get("losses") or []
        step_s = f"{_num(figure, '.3f')}{mark if figure is not None else ''} / {_num(r.get('predicted_step_s'), '.3f')}"
        budget = _gib(r.get("budget_bytes")) if r["system"].startswith("slidedp") else "–"
        rule = ", stops on a non-finite gradient" if r.get("nonfinite") == "stop" else ""
        name = NAMES.get(r["system"], r["system"]) + (f" (no clipping{rule})" if clip(r) is None else "")
        micro = r.get("slidedp_micro_rows" if r["system"].startswith("slidedp") else "baseline_micro_rows", 1)
        details = [f"{micro}-row micro-batches"] if micro > 1 else []
        blocks = re.search(r"of (\d+)", r.get("activation_checkpointing") or "")
        if r.get("checkpointed_blocks") is not None and blocks:
            details.append(f"{r['checkpointed_blocks']}/{blocks.group(1)} blocks checkpointed")
        if details:
            name += f" ({', '.join(details)})"
        cells = [shape(r)] * several + [f"{r['tokens_per_step']:,}", name, budget, speed, *ratios,
                                        f"{_gib(r.get('peak_device_bytes'))} / {_gib(r.get('peak_device_reserved_bytes'))}",
                                        f"{_gib(r.get('peak_host_bytes'))} / {_gib(r.get('peak_host_bytes_incl_build'))}",
                                        _gib(r.get("host_used_bytes")),
                                        step_s, _num(losses[0] if losses else None, ".5f")]
        lines.append("| " + " | ".join(cells) + " |")
    note = marks_note(rows)
    return "\n".join(lines) + (f"\n\n{note}." if note else "")


def baseline_configs(records: list[dict]) -> list[str]:
    """How each GPU-resident point ran: its checkpointed blocks and whether its blocks were compiled
    (records older than the best-configuration baseline checkpointed every block, eager)."""
    out = []
    for r in records:
        if r.get("system") != "gpu_resident" or r.get("error"):
            continue
        if "checkpointed_blocks" in r:
            blocks = f"{r['checkpointed_blocks']} block(s) checkpointed (the fewest that fit)"
        else:
            blocks = "every block checkpointed (older record)"
        out.append(f"{r['tokens_per_step']} tokens: {blocks}, blocks {'compiled' if r.get('compiled_blocks') else 'eager'}")
    return out or ["no point"]


def deepspeed_configs(records: list[dict]) -> list[str]:
    """How each DeepSpeed point ran: version, ZeRO stage, what was offloaded, its optimizer, the
    checkpointed blocks; or why it did not run."""
    out = []
    for r in records:
        if r.get("system") not in DEEPSPEED_SYSTEMS:
            continue
        head = f"{NAMES[r['system']]}, {r['tokens_per_step']} tokens"
        if r.get("error"):
            out.append(f"{head}: did not run ({r['error'].splitlines()[0][:200]})")
            continue
        out.append(f"{head}: DeepSpeed {r.get('deepspeed')}, {r.get('optimizer')}, "
                   f"{r.get('checkpointed_blocks')} block(s) checkpointed")
    return out


def render_section(records: list[dict], out_path: Path | str | None = None) -> str:
    """The README section: title, commands, hardware, table and how it was measured."""
    dates = sorted({r["date"] for r in records if r.get("date")})
    commands = sorted({r["command"] for r in records if r.get("command")})
    devices = sorted({r["device_name"] for r in records if r.get("device_name")})
    soft = sorted({f"torch {r['torch']}, transformers {r['transformers']}" for r in records if r.get("torch")})
    hosts = sorted({f"{r['host_cpu']}, {r['host_cores']} cores, {_gib(r.get('host_mem_bytes'))} GiB RAM"
                    for r in records if r.get("host_cpu")})
    commits = sorted({r["git_commit"] for r in records if r.get("git_commit")})
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    shapes = sorted({r.get("shape", "4b") for r in records})
    params = sorted({r["params"] for r in records if r.get("params")})
    cards = " or ".join(devices) or "one GPU"
    title = f"Every system on one machine, Qwen3-4B shape, {cards}" if shapes == ["4b"] else \
        f"Every system on one machine, shapes {', '.join(shapes)}, {cards}"
    lines = [f"## {title} ({', '.join(dates) or 'not run'})", ""]
    lines += [f"`{c}`" for c in commands]
    rel = None
    if out_path is not None:
        out_path = Path(out_path)
        with contextlib.suppress(ValueError):
            rel = out_path.resolve().relative_to(HERE)
    lines.append(f"(records: `{rel or (out_path.name if out_path else 'results/')}`; slidedp's plans: "
                 "where each command's `--plans-dir` put them, by default `plans/` beside the records)")
    lines += ["", f"Hardware: {'; '.join(devices) or '?'}; host {'; '.join(hosts) or '?'}; {'; '.join(soft)}"
              + (f"; commit {', '.join(commits)}" if commits else "") + "."]
    lines += [f"Model: Qwen3 shape `{', '.join(shapes)}`, {', '.join(f'{p:,}' for p in params)} parameters, "
              f"untied, random init; slidedp budget {', '.join(_gib(b) + ' GiB' for b in budgets) or '–'}.", ""]
    lines.append(render_table(records))
    micro = sorted({r.get("baseline_micro_rows", 1) for r in records})
    optimizers = sorted({f"{NAMES.get(r['system'], r['system'])}: {r['optimizer']}" for r in records
                         if r.get("optimizer")})
    notes = (
        "Same model and batches in every system: each parameter is initialised from its own seeded generator "
        "on the same device and rounded to bf16, so every system starts from bit-identical weights; the "
        "batches are seeded per step; the warm-up step is training step 1 on the same batch, so the step-1 "
        "losses must agree to bf16 tolerance. AdamW lr 1e-5 (weight decay 0), global clipping to 1.0, "
        "token-weighted loss, gradient accumulation over micro-batches of "
        f"{' / '.join(map(str, micro))} x seq rows in every system. GPU-resident: fp32 parameters, bf16 "
        "autocast, fused AdamW on the GPU; as run: " + "; ".join(baseline_configs(records)) + ". FSDP2: `fully_shard` per "
        "block and on the root, `CPUOffloadPolicy(pin_memory=True)`, bf16 parameters / fp32 reduction, AdamW "
        "on the CPU, activation checkpointing of every block. "
        + ("DeepSpeed ZeRO-Offload (benchmarks/common/deepspeed_zero.py): ZeRO-2 or ZeRO-3 in one process "
           "(no launcher), bf16, `offload_optimizer` to pinned CPU memory with DeepSpeedCPUAdam (AdamW mode), "
           "overlap_comm and contiguous gradients, `offload_param` too where named, the fewest leading blocks "
           "checkpointed that fit (probed); as run: " + "; ".join(deepspeed_configs(records)) + ". "
           if deepspeed_configs(records) else "")
        + "Optimizers as run: " + "; ".join(optimizers) + ". "
        "Tokens/s and step time: the median over the steady steps, the timed steps after one warm-up step but "
        "the first (no earlier CPU update to wait for) and the last (which waits for slidedp's final "
        "asynchronous CPU update). Peak device = `torch.cuda.max_memory_allocated()` after the build; peak host = the "
        "process's VmHWM after the build (slidedp's shared-memory host state counts); host used = the machine's "
        "MemTotal - MemAvailable above its value when the point's process started, which also counts pinned "
        "buffers that the CUDA driver maps outside RSS. Ratios: tokens/s over the baseline's at the same tokens "
        "per step. Each point ran in its own process, one after the other."
    )
    lines += ["", textwrap.fill(notes, width=100, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines)


def update_readme(path: Path, section: str, begin: str = README_BEGIN, end: str = README_END) -> None:
    """Replace the marked section of `path` by `section` (appended, with its markers, if absent)."""
    _update_readme(path, section, begin, end)


# -- offline planning ---------------------------------------------------------------------------------------

def solve_point(shape: str, tokens: int, budget: str, hardware, *, seq: int | None = None, precision: str = "bf16",
                micro_rows: int = 1, max_grad_norm=MAX_GRAD_NORM, nonfinite: str = "skip", host_ram=None,
                compile_blocks=None, group_rows: bool = False):
    """slidedp's plan of one point on a meta-device model (no GPU, no weights), as the benchmark's
    compile would solve it there (`group_rows`: its `micro_rows`-row micro-batches regrouped as predicted
    fastest)."""
    import torch

    import slidedp

    seq = seq or SHAPES[shape]["seq"]
    model = empty_model(shape, dtype=torch.bfloat16 if precision == "bf16" else torch.float32, device="cpu")
    return slidedp.plan(model, budget, batch_size=micro_rows, seq_len=seq, precision=precision,
                        micro_batches=tokens // seq // micro_rows, hardware=hardware,
                        optimizer=slidedp.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                        max_grad_norm=max_grad_norm, compile_blocks=compile_blocks, host_memory=host_ram,
                        nonfinite=nonfinite, group_rows=group_rows)


def solve_plans(args) -> int:
    """Solve slidedp's plan of every --tokens point for --hardware and save them where the benchmark
    saves its plans, for `--plan` on a machine without OR-Tools."""
    # the eager system alone: its plan counts eager blocks' saved activations
    compile_blocks = False if "slidedp" not in args.systems and "slidedp_eager" in args.systems else None
    for tokens in args.tokens:
        plan = solve_point(args.shape, tokens, args.budget, args.hardware or "h200-sxm", seq=args.seq,
                           precision=args.precision or "bf16", micro_rows=args.slidedp_micro_rows,
                           max_grad_norm=args.max_grad_norm, nonfinite=args.nonfinite, host_ram=args.host_ram,
                           compile_blocks=compile_blocks)
        path = Path(args.plans_dir) / f"qwen3_{args.shape}_{tokens}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        print(f"{path}: predicted {plan.predicted_step_time_s:.3f} s/step\n{plan.summary()}", flush=True)
    return 0


def _records(path: Path) -> list[dict]:
    """The records of a results file (a JSON list of records; anything else holds none)."""
    data = json.loads(path.read_text())
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


MIN_POINT_S = 60.0  # with --time-left-s: a point needs at least this long (a child's start and a model's build)


def registered_point_s(point: dict, steps: int, host_bytes: int = 0, compiled_before: bool = False) -> float:
    """About how long a registered point takes: a child's start (20 s), the model's build (15 s and 0.5 s
    per GiB of the plan's host memory, which the host state's first writes take), the warm-up's
    compilations (25 s; 8 s where `compiled_before`: a point of the same shape and micro-batch rows compiled
    its blocks earlier in the run, and Inductor's cache on disk serves them), then the warm-up and timed steps
    at its predicted step with a quarter to spare. The records of 2026-12-05/06 ran within a few seconds of it
    or under (a Qwen3-8B point of 108 GiB of host memory built in 81 s and was cut off after two steps when 75 s
    was all a build was given); on 2026-12-07 a second Qwen3-1.7B point's warm-up took 7.8 s, the first's 23.9."""
    return 35.0 + (8.0 if compiled_before else 25.0) + 0.5 * host_bytes / 2**30 + \
        (steps + 1) * point["predicted_step_s"] * 1.25


def registered_plan_path(point: dict) -> Path | None:
    """A registered point's plan file, or None where it is not in the repository."""
    path = REPO / point.get("plan_file", "")
    return path if point.get("plan_file") and path.is_file() else None


def compile_key(point: dict) -> tuple:
    """What a point's compiled blocks depend on beyond the code: its shape and rows per micro-batch (its
    registered plan's, where the plan groups them)."""
    path = registered_plan_path(point)
    rows = point.get("slidedp_micro_rows")
    if path is not None:
        rows = json.loads(path.read_text()).get("workload", {}).get("batch_size", rows)
    return point["shape"], rows


def plan_host_bytes(point: dict) -> int:
    """The host memory of a registered point's plan (0 where its file is not in the repository)."""
    path = registered_plan_path(point)
    if path is None:
        return 0
    return int(json.loads(path.read_text()).get("explanation", {}).get("peak_host_bytes", 0))


def plan_refusal(point: dict) -> str | None:
    """Why today's compile would refuse a registered point's plan (its program checked against the point's
    budget on a meta-device model, as slidedp.compile checks it after the model's build), or None. A plan
    registered before a change to what a program is charged may no longer fit its budget."""
    import slidedp.api
    from slidedp.backend.lowering.verify import ProgramError

    path = registered_plan_path(point)
    if path is None:
        return None
    plan = slidedp.Plan.load(path)
    graph = plan_graph_of(plan, point["shape"])
    try:
        slidedp.api.verify(slidedp.api.lower_plan(graph, plan), slidedp.Budget.parse(point["budget"]))
    except ProgramError as e:
        return str(e)
    return None


def calibrate_host_once(record: dict, args) -> Path | None:
    """`slidedp calibrate --host-only` of the host that runs, on the first point's hardware, into host.json
    beside --out (once per --out folder: an earlier one there is reused), or None where it failed; each
    point's record then also holds its plan's step predicted with it, before its first step."""
    hardware = next((h for point in record["points"] for h in _hardware_args(point["command"])), None)
    out = Path(args.out or "host.json").with_name("host.json")
    if out.is_file():
        return out
    if hardware is None:
        print("=== no host calibration: the points name no --hardware", file=sys.stderr, flush=True)
        return None
    cuda = args.device.startswith("cuda")  # the CPU device is the smoke test: its quick sizes
    done = subprocess.run([sys.executable, "-m", "slidedp", "calibrate", "--host-only", hardware, "--out", str(out),
                           "--device", "cuda" if cuda else "cpu", *(() if cuda else ("--quick",))], cwd=REPO)
    if done.returncode != 0 or not out.is_file():
        print(f"=== no host calibration: slidedp calibrate --host-only exited {done.returncode}; the points run with "
              "their registered prediction alone", file=sys.stderr, flush=True)
        return None
    return out


def _hardware_args(command: str) -> list[str]:
    """The --hardware values of a point's command."""
    words = shlex.split(command)
    return ([words[i + 1] for i, w in enumerate(words[:-1]) if w == "--hardware"]
            + [w.split("=", 1)[1] for w in words if w.startswith("--hardware=")])


def run_registered(args) -> int:
    """Every point of the registration record `args.registered` not yet measured in this study's results
    or in --out (records of an earlier run there, merged into), in its order: the point's own command (its
    shape, tokens, budget, hardware and registered plan) into --out, on --device, with what is left of
    --time-left-s."""
    record = json.loads(Path(args.registered).read_text())
    cards = {card_of(point["hardware"]) for point in record["points"]}
    import torch

    if args.device.startswith("cuda") and torch.cuda.is_available():
        here = torch.cuda.get_device_name(torch.device(args.device))
        if not all(card in here for card in cards):  # a run on another card would count for nothing
            print(f"=== not run: {args.registered} was registered for {', '.join(sorted(cards))}, this is {here}",
                  file=sys.stderr, flush=True)
            return 2
    done = [*(HERE / "results").glob("*.json"), *([Path(args.out)] if args.out and Path(args.out).exists() else [])]
    measured = {r.get("plan_sha256") for path in done for r in _records(path)
                if r.get("error") is None and r.get("median_step_s")}
    start = time.monotonic()
    compiled: set[tuple] = set()  # compile_key of the points started in this run
    host_profile = calibrate_host_once(record, args) if args.host_calibration else None
    for point in record["points"]:
        if point["plan_sha256"] in measured and not args.remeasure:  # in this study's records already
            print(f"=== {point['shape']}, {point['tokens_per_step']} tokens/step: measured already", flush=True)
            continue
        refused = plan_refusal(point)
        if refused:  # its compile would fail after the model's build: not worth the build
            print(f"=== {point['shape']}, {point['tokens_per_step']} tokens/step: not run, its plan is refused today: "
                  f"{refused}", file=sys.stderr, flush=True)
            continue
        argv = [args.out if a == "OUT.json" else a for a in shlex.split(point["command"])[2:]]  # after python run.py
        argv += ["--device", args.device, "--timeout-s", str(args.timeout_s)]
        key = compile_key(point)
        if args.time_left_s is not None:
            left = args.time_left_s - (time.monotonic() - start)
            need = registered_point_s(point, int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 12,
                                      plan_host_bytes(point), key in compiled)
            if left < need:  # a point cut by the time limit measures nothing: the next one may fit
                print(f"=== {point['shape']}, {point['tokens_per_step']} tokens/step: not started, about {need:.0f} s "
                      f"needed, {left:.0f} s left", file=sys.stderr, flush=True)
                continue
            argv += ["--time-left-s", str(left)]
        if args.allow_dirty:
            argv.append("--allow-dirty")
        if host_profile:
            argv += ["--host-profile", str(host_profile)]
        compiled.add(key)
        main(argv)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens per step")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    add_model_args(p, several_micro_rows=True)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke test)")
    p.add_argument("--budget", default="40GiB", help="slidedp's device-memory budget")
    p.add_argument("--out", help="records (default: results/<today>-qwen3-<shape>.json in this folder)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per (system, tokens) point")
    p.add_argument("--plan", help="slidedp: reuse pre-solved plans (--solve-plans); template with {tokens} and {shape}")
    p.add_argument("--plans-dir", help="where slidedp's plans are saved (default: plans/ beside --out)")
    p.add_argument("--hardware", help="slidedp hardware preset or profile (default: detected)")
    p.add_argument("--deepspeed-checkpoint", type=checkpoint_choice, default="auto",
                   help="DeepSpeed: blocks with activation checkpointing: 'auto' (the fewest leading blocks that fit, "
                        "probed on the bare model before deepspeed.initialize; default), 'all', 'none' or a number")
    p.add_argument("--slidedp-micro-rows", type=int, default=1,
                   help="rows (sequences) per slidedp micro-batch: batch_size of compile (default 1)")
    add_record_args(p, readme_path=str(HERE / "README.md"))
    p.add_argument("--render", metavar="JSON", help="only render the table of an existing records file")
    p.add_argument("--solve-plans", action="store_true", help="only solve and save slidedp's plans (no GPU)")
    p.add_argument("--host-ram", help="with --solve-plans: host RAM available on the machine that will run them "
                                      "(e.g. 125GiB, the H200 host's), bounding activation offload as there")
    p.add_argument("--registered", metavar="JSON", help="run every point of a registration record "
                   "(predict_vs_measured/register.py) with its registered plan, in order, into --out")
    p.add_argument("--host-calibration", action="store_true", help="with --registered: first measure this host "
                   "(slidedp calibrate --host-only, under a minute) and record each point's plan predicted again "
                   "with it, before the point runs, beside the registered prediction")
    p.add_argument("--host-profile", help="slidedp: also record the plan's step predicted with this host profile's "
                   "CPU and host fields (slidedp calibrate --host-only), before the first step")
    p.add_argument("--remeasure", action="store_true", help="with --registered: also the points measured already "
                   "(after a change of the runtime that leaves their plans as they were)")
    p.add_argument("--time-left-s", type=float, help="seconds this run may take: a point starts only with "
                   f"{MIN_POINT_S:.0f} s left (a registered one: with about its build and steps at its predicted "
                   "step) and its timeout is cut to what is left (a point not run is said, not recorded)")
    # worker side (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or min(args.baseline_micro_rows) < 1 or args.slidedp_micro_rows < 1 or min(args.tokens) < 1:
        p.error("--steps, --baseline-micro-rows, --slidedp-micro-rows and --tokens must be positive")
    if args.out is None:
        args.out = str(HERE / "results" / f"{datetime.date.today().isoformat()}-qwen3-{args.shape}.json")
    if args.plans_dir is None:
        args.plans_dir = str(Path(args.out).resolve().parent / "plans")
    if args.render:
        records = json.loads(Path(args.render).read_text())
        print(render_table(records))
        if args.readme:
            update_readme(Path(args.readme_path), render_section(records, args.render))
        return 0
    if args.solve_plans:
        return solve_plans(args)
    if args.registered:
        return run_registered(args)
    if args.worker:
        args.tokens, args.baseline_micro_rows = args.tokens[0], args.baseline_micro_rows[0]
        return worker(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())

