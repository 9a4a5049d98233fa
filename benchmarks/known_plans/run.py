"""Plans for the configurations slidedp is known for, solved on any machine (no GPU), with their
predicted step times: a record of what the planner promises, to be measured against where the
hardware exists.

    python benchmarks/known_plans/run.py --out benchmarks/known_plans/results/<date>-<what>.json
    python benchmarks/known_plans/run.py --only qwen3-4b-h200x4   # one configuration

Each configuration is a preset shape (slidedp/train/shapes.py, random weights on the meta device), a
hardware preset, ranks and hosts, a device budget per GPU, the host RAM per host, and a workload.
The schedule of every plan found (what `slidedp.compile(plan=...)` takes, without its explanation)
is written to `plans/<name>.json` beside this file and kept in git; the record has the predicted
step, the memory per GPU and per host, who decided what (`chosen_by`), the plan's sha256, or the
error and the smallest budgets that would plan when none is found. Predictions are the cost model's:
none of these configurations was measured unless benchmarks/LOG.md says so.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402

import argparse  # noqa: E402
import hashlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

HERE = _Path(__file__).resolve().parent
GIB = 1 << 30


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a preset of slidedp/train/shapes.py
    hardware: str
    world_size: int  # every rank of every host
    budget_gib: float  # device memory per GPU; 0: the smallest that plans (the floor), found by the planner
    host_memory_gib: float  # per host; 0: the least that plans (the leanest host layout), found by the planner
    seq_len: int
    micro_batches: int  # per rank and pass over the weights, one row each
    hosts: int = 1
    link: str | None = None  # between hosts (costmodel/hardware.py LINKS)
    passes: int = 1  # passes over the weights per step (`step()` with passes x micro_batches rows per rank)
    clip: bool = True  # gradient clipping at 1.0
    nonfinite: str = "skip"  # "stop" (without clipping) lets the plan stream the gradients into the update
    routes: tuple[str, str] | None = None  # (delivery, reduction) forced on every layer (SolverOptions); None: any

    @property
    def tokens_per_step(self) -> int:
        return self.world_size * self.micro_batches * self.seq_len * self.passes


def _h200(shape: str, gpus: int) -> Config:
    # 65,536 tokens per step, split over the GPUs: the strong-scaling point of multi_gpu_scaling
    return Config(f"qwen3-{shape}-h200x{gpus}", f"qwen3-{shape}", "h200-sxm", gpus, 40, 118 if gpus == 1 else 1800,
                  4096, 16 // gpus)


CONFIGS = (
    Config("qwen3-14b-h100x4-4096", "qwen3-14b", "h100-sxm", 4, 70, 1800, 1024, 1),
    # 1,048,576 tokens: 16 passes of 4 micro-batches of 4096 tokens per rank (one pass of 64 would keep 105 GiB
    # of block inputs on each GPU)
    Config("qwen3-14b-h100x4-1m", "qwen3-14b", "h100-sxm", 4, 70, 1800, 4096, 4, passes=16),
    Config("qwen2.5-72b-rtx4090x4", "qwen2.5-72b", "rtx4090", 4, 24, 1200, 4096, 1),
    Config("qwen2.5-72b-4hosts-rtx4090x4", "qwen2.5-72b", "rtx4090", 16, 24, 512, 4096, 1, hosts=4,
           link="eth-1x100"),
    # the least host RAM per host that plans: the leanest host layout (delivery copies made on load; the
    # gradients kept: without peer-to-peer the CPUs sum the ranks' gradients into them)
    Config("qwen2.5-72b-rtx4090x4-leanest-host", "qwen2.5-72b", "rtx4090", 4, 24, 0, 4096, 1),
    # across hosts every layer is reduced on the GPUs: without clipping and with nonfinite="stop" the
    # gradients stream into the update too (12 bytes per parameter of state)
    Config("qwen2.5-72b-4hosts-rtx4090x4-leanest-host", "qwen2.5-72b", "rtx4090", 16, 24, 0, 4096, 1, hosts=4,
           link="eth-1x100", clip=False, nonfinite="stop"),
    # one host, the GPU reduction forced (its collectives through host memory: RTX 4090s have no
    # peer-to-peer) so that the gradients stream too
    Config("qwen2.5-72b-rtx4090x4-leanest-host-gpu-reduction", "qwen2.5-72b", "rtx4090", 4, 24, 0, 4096, 1,
           clip=False, nonfinite="stop", routes=("sharded", "gpu")),
    # Qwen3-14B on the one-H200 machine (118 GiB of host RAM); without clipping and with nonfinite="stop"
    # the gradients may stream into the update (no gradient in host RAM)
    Config("qwen3-14b-h200x1-16384", "qwen3-14b", "h200-sxm", 1, 130, 118, 4096, 4),
    Config("qwen3-14b-h200x1-65536", "qwen3-14b", "h200-sxm", 1, 130, 118, 4096, 16),
    Config("qwen3-14b-h200x1-65536-stop", "qwen3-14b", "h200-sxm", 1, 130, 118, 4096, 16, clip=False,
           nonfinite="stop"),
    # the floors of the Qwen3-4B shape on one GPU, no clipping as SlideFormer's figures (5.3 and 6.7 GiB)
    Config("qwen3-4b-h200x1-floor-4096", "qwen3-4b", "h200-sxm", 1, 0, 118, 4096, 1, clip=False),
    Config("qwen3-4b-h200x1-floor-16384", "qwen3-4b", "h200-sxm", 1, 0, 118, 4096, 4, clip=False),
    # a tied embedding and head (Llama-3.2-3B as released): the tied table streams for both its uses
    Config("llama3.2-3b-h200x1-floor-4096", "llama3.2-3b", "h200-sxm", 1, 0, 118, 4096, 1, clip=False),
    Config("llama3.2-3b-h200x1-floor-16384", "llama3.2-3b", "h200-sxm", 1, 0, 118, 4096, 4, clip=False),
    *(_h200(shape, gpus) for shape in ("4b", "8b") for gpus in (1, 2, 4, 8)),
)


def solve(config: Config) -> dict:
    """The plan of `config` (saved under plans/), or why there is none, as one record."""
    import torch
    import transformers

    import slidedp
    from slidedp.train.shapes import preset_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(preset_config(config.model)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    record = {**asdict(config), "params": params, "tokens_per_step": config.tokens_per_step}
    t0 = time.perf_counter()

    host_memory = f"{config.host_memory_gib}GiB" if config.host_memory_gib else None

    def plan_at(budget):
        return slidedp.plan(model, budget, batch_size=1, seq_len=config.seq_len, world_size=config.world_size,
                            micro_batches=config.micro_batches, precision="bf16", hardware=config.hardware,
                            host_memory=host_memory, hosts=config.hosts, link=config.link,
                            compile_blocks=True, max_grad_norm=1.0 if config.clip else None,
                            nonfinite=config.nonfinite, solver_options=None if config.routes is None else
                            slidedp.SolverOptions(deliveries=config.routes[:1], reductions=config.routes[1:]))

    try:
        if not config.host_memory_gib:  # the least host RAM that plans, then the plan there
            host_memory = 1
            try:
                plan_at(f"{config.budget_gib}GiB")
                raise AssertionError("a plan within 1 byte of host RAM")
            except slidedp.InfeasibleBudgetError as e:
                record["leanest_host_bytes"] = host_memory = e.min_host_bytes
        if config.budget_gib:
            plan = plan_at(f"{config.budget_gib}GiB")
        else:
            try:
                plan_at(1)
                raise AssertionError("a plan within 1 byte")
            except slidedp.InfeasibleBudgetError as e:
                record["floor_bytes"] = e.min_budget_bytes
            plan = plan_at(record["floor_bytes"])
    except slidedp.InfeasibleBudgetError as e:
        record.update(error=str(e).splitlines()[0], min_budget_bytes=e.min_budget_bytes,
                      min_host_bytes=getattr(e, "min_host_bytes", None), solve_s=time.perf_counter() - t0)
        return record
    path = HERE / "plans" / f"{config.name}.json"
    path.parent.mkdir(exist_ok=True)
    plan.save(path, explanation=False)
    # several passes: each pass is the plan's (weights streamed again), so passes x the one-pass step: an
    # estimate, not the simulator's (the update, once per step, is counted every pass; the host-side sum of
    # the passes' gradients is not counted)
    step_s = plan.predicted_step_time_s * config.passes
    record.update(predicted_step_is_estimate=config.passes > 1, predicted_pass_s=plan.predicted_step_time_s,
        plan_file=str(path.relative_to(HERE)), plan_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        predicted_step_s=step_s, predicted_tokens_per_s=config.tokens_per_step / step_s,
        peak_device_bytes=plan.peak_device_bytes, peak_host_bytes=plan.peak_host_bytes,
        host_bytes_per_param=plan.peak_host_bytes / params, chosen_by=plan.solver.get("chosen_by"),
        searches=plan.solver.get("searches"),
        solve_s=time.perf_counter() - t0)
    return record


def strong_scaling(records: list[dict]) -> dict[str, float]:
    """Planned strong-scaling efficiency of each configuration against the one-GPU configuration of the
    same model, hardware, budget and tokens per step (where there is one)."""
    def key(r):
        return r["model"], r["hardware"], r["budget_gib"], r["tokens_per_step"]

    planned = [r for r in records if "predicted_step_s" in r]
    one = {key(r): r["predicted_tokens_per_s"] for r in planned if r["world_size"] == 1}
    return {r["name"]: r["predicted_tokens_per_s"] / (r["world_size"] * one[key(r)]) for r in planned
            if key(r) in one}


def render(records: list[dict]) -> str:
    """A markdown table of the records."""
    from benchmarks.common.tables import gib, markdown_table, num

    eff = strong_scaling(records)
    rows = []
    for r in records:
        where = f"{r['hosts']} x {r['world_size'] // r['hosts']} {r['hardware']}"
        budget = f"floor {gib(r['floor_bytes'])}" if r.get("floor_bytes") else f"{r['budget_gib']:g}"
        if r.get("leanest_host_bytes"):
            budget += f", host at its least ({gib(r['leanest_host_bytes'])})"
        if "predicted_step_s" in r:
            bound = "~" if r.get("predicted_step_is_estimate") else ""
            rows.append([r["name"], where, budget, f"{r['tokens_per_step']:,}", bound + num(r["predicted_step_s"], ".3f"),
                         bound + f"{r['predicted_tokens_per_s']:,.0f}",
                         f"{eff[r['name']]:.0%}" if r["name"] in eff else "–",
                         gib(r["peak_device_bytes"]), gib(r["peak_host_bytes"]), num(r["host_bytes_per_param"], ".2f")])
        else:
            rows.append([r["name"], where, budget, f"{r['tokens_per_step']:,}", "no plan: " + r["error"][:160],
                         "–", "–", "–", "–", "–"])
    return markdown_table(["configuration", "GPUs", "budget GiB per GPU", "tokens/step", "predicted step s", "predicted tokens/s",
                           "planned strong eff. (vs 1 GPU)", "peak device GiB per GPU", "peak host GiB per host",
                           "host B/param"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the record (JSON)")
    p.add_argument("--only", nargs="+", help="configuration names (default: all)")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    stamp = commit_stamp(args.allow_dirty)
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only]
    unknown = set(args.only or ()) - {c.name for c in CONFIGS}
    if unknown:
        p.error(f"unknown configuration(s) {sorted(unknown)}; known: {', '.join(c.name for c in CONFIGS)}")
    records = []
    for i, config in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {config.name} ...", flush=True)
        record = solve(config)
        print(f"  {record.get('predicted_step_s', 'no plan')}"
              f"{' s/step' if 'predicted_step_s' in record else ': ' + record.get('error', '')}", flush=True)
        records.append({**stamp, **record, "command": " ".join(["python", "benchmarks/known_plans/run.py",
                                                                *(argv if argv is not None else sys.argv[1:])])})
    print(render(records))
    if args.out:
        write_records(_Path(args.out), records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
