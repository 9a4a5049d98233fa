"""Predicted against measured step time, for the slidedp plans that ran in a benchmark.

    python benchmarks/predict_vs_measured/run.py --records benchmarks/predict_vs_measured/results/2026-12-03-validation-eager-blocks-records.json \
        --plans 'benchmarks/single_gpu_throughput/results/plans/qwen3_4b_{tokens}.json' --hardware h200-sxm \
        --out benchmarks/predict_vs_measured/results/DATE-WHAT.json

For each slidedp record: the plan that ran (its decisions, loaded from the saved plan) is simulated
again under --hardware (a preset or a calibrated profile JSON), on the Qwen3 shape of the record
(meta device, nothing allocated). Printed and written per point:

* measured_step_s: the benchmark's figure (timed steps / steps, the last CPU update included);
* steady_step_s: mean of the overlapped steps (those that waited over 50 ms for the previous update);
* predicted_step_s: the simulated step period (the previous step's update paces the forward);
* measured_pass_s / predicted_pass_s: the first timed step, whose previous update had finished
  (no overlap), against the same plan simulated with an infinitely fast CPU update;
* predicted_in_run_s: what the plan predicted when it was solved during the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.fit_set import used_in_fitting  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

from slidedp.costmodel.hardware import resolve_hardware  # noqa: E402
from slidedp.ir.build import build_layer_graph  # noqa: E402
from slidedp.scheduler.problem.costs import ProblemCosts  # noqa: E402
from slidedp.scheduler.decisions import Decisions, LayerChoice, Problem  # noqa: E402
from slidedp.scheduler.plan import Plan  # noqa: E402
from slidedp.scheduler.oracles.timeline import simulate  # noqa: E402


def decisions_of(plan: Plan) -> Decisions:
    last = len(plan.decisions) - 1
    order = "head_first" if len(plan.update_order) > 1 and plan.update_order[1] == last else "forward"
    on_device = set(plan.device_state)
    return Decisions(plan.window, order, tuple(LayerChoice(d.chunks, d.activation, d.delivery, d.reduction,
                                                           on_device=d.layer_id in on_device)
                                               for d in plan.decisions))


def render(rows: list[dict]) -> str:
    """The table, a row a point, with whether its configuration was used in fitting the preset, and
    the share of held-out points predicted within 10%."""
    head = "| shape | tokens/step | activation | measured step s | steady step s | predicted step s | error | " \
           "pass alone s, measured / predicted | predicted during the run | used in fitting |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        act = ", ".join(f"{n} {a}" for a, n in row["activation"].items() if a != "resident")
        steady = "–" if row["steady_step_s"] is None else f"{row['steady_step_s']:.3f}"
        meas_pass = "–" if row["measured_pass_s"] is None else f"{row['measured_pass_s']:.3f}"
        in_run = "–" if row["predicted_in_run_s"] is None else f"{row['predicted_in_run_s']:.3f}"
        lines.append(f"| {row.get('shape', '4b')} | {row['tokens_per_step']:,} | {act} | {row['measured_step_s']:.3f} | "
                     f"{steady} | {row['predicted_step_s']:.3f} | {row['error']:+.1%} | {meas_pass} / "
                     f"{row['predicted_pass_s']:.3f} | {in_run} | {'yes' if row['used_in_fitting'] else 'no'} |")
    held = [r for r in rows if not r["used_in_fitting"]]
    within = sum(1 for r in held if abs(r["error"]) <= 0.10)
    lines.append("")
    lines.append(f"Held-out points (configurations not used in fitting) within 10%: {within} of {len(held)}"
                 + ("" if held else " (no held-out point in these records)") + ".")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", required=True)
    p.add_argument("--plans", required=True, help="path template with {tokens} (and {shape})")
    p.add_argument("--hardware", default="h200-sxm")
    p.add_argument("--out")
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    hw = resolve_hardware(args.hardware, "cuda" if args.hardware == "auto" else "cpu")
    no_update = dataclasses.replace(hw, cpu_adamw_params_per_s=1e18)
    records = [r for r in json.loads(Path(args.records).read_text())
               if r["system"].startswith("slidedp") and not r.get("error")]
    graphs = {}
    rows = []
    for r in sorted(records, key=lambda r: r["tokens_per_step"]):
        shape = r.get("shape", "4b")
        if shape not in graphs:
            with torch.device("meta"):
                from transformers import Qwen3ForCausalLM

                model = Qwen3ForCausalLM(bench.qwen3_config(shape)).to(torch.bfloat16)
            seq = bench.SHAPES[shape]["seq"]
            graphs[shape] = build_layer_graph(model, batch_size=1, seq_len=seq, compute_dtype=torch.bfloat16)
        graph = graphs[shape]
        plan = Plan.load(args.plans.format(tokens=r["tokens_per_step"], shape=shape))
        m = plan.workload.micro_batches
        d = decisions_of(plan)
        compiled = bool(r.get("compile_blocks", plan.workload.compiled_blocks))
        on_device = frozenset(plan.device_state)
        step = simulate(ProblemCosts(Problem(graph, hw, 1, m, plan.loss_chunk_tokens, compiled,
                                             device_state=on_device)), d).step_s
        pass_only = simulate(ProblemCosts(Problem(graph, no_update, 1, m, plan.loss_chunk_tokens, compiled,
                                                  device_state=on_device)), d).step_s
        info = r.get("step_info") or []
        timed = info[1:]  # info[0] is the warm-up step
        overlapped = [s["pass_s"] for s in timed if s.get("wait_s", 0) > 0.05]
        row = {
            "tokens_per_step": r["tokens_per_step"], "micro_batches": m,
            "activation": {a: sum(1 for x in plan.decisions if x.activation == a)
                           for a in sorted({x.activation for x in plan.decisions})},
            "measured_step_s": r["measured_step_s"],
            "steady_step_s": sum(overlapped) / len(overlapped) if overlapped else None,
            "predicted_step_s": step,
            "error": step / r["measured_step_s"] - 1,
            "measured_pass_s": timed[0]["pass_s"] if timed else None,
            "predicted_pass_s": pass_only,
            "predicted_in_run_s": r.get("predicted_step_s"),
            "shape": shape,
            "used_in_fitting": used_in_fitting(r, args.hardware),
        }
        rows.append(row)
    print(render(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({**stamp, "hardware": hw.to_dict(), "records": args.records,
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
