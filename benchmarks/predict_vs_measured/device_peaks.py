"""Today's device-memory model on the plans that ran: each slidedp point of single_gpu_throughput with a
measured peak, its plan lowered again into a program (as `slidedp.compile` lowers it) and the program's
peak (`verify_program`) set beside the peak predicted before the run and the measured peaks, allocated
and reserved by the CUDA allocator over the timed steps.

    python benchmarks/predict_vs_measured/device_peaks.py \
        --out benchmarks/predict_vs_measured/results/DATE-device-peaks-in-hindsight.json

Plans are found by sha256 as run.py finds them (registered/, ran/ and --plans folders). A program whose
peak is under the measured allocated peak would have let the allocator run past the budget: the model
is meant to stay over it, by little.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table  # noqa: E402
from benchmarks.predict_vs_measured.run import RESULTS, plan_files  # noqa: E402

import slidedp  # noqa: E402
import slidedp.api  # noqa: E402
from slidedp.backend.lowering.verify import verify_program  # noqa: E402

GiB = 2**30


def measured_points() -> list[dict]:
    """Every slidedp record with a measured peak and a plan sha256, in the order of the records' files."""
    import json

    points = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else []:
            if (isinstance(r, dict) and str(r.get("system", "")).startswith("slidedp") and r.get("plan_sha256")
                    and r.get("steps_peak_device_bytes") and r.get("predicted_peak_device_bytes")):
                points.append({**r, "record": path.name})
    return points


def program_peak_bytes(plan: slidedp.Plan, shape: str) -> int:
    """The peak of the program today's code lowers `plan` into, on a meta-device model of `shape`."""
    dtype = torch.bfloat16 if plan.workload.precision == "bf16" else torch.float32
    graph = slidedp.api.plan_graph(bench.empty_model(shape, dtype=dtype, device="meta"), plan)
    return verify_program(slidedp.api.lower_plan(graph, plan)).peak_device_bytes


def peak_rows(plans: dict[str, dict]) -> list[dict]:
    rows = []
    for r in measured_points():
        data = plans.get(r["plan_sha256"])
        today = None if data is None else program_peak_bytes(slidedp.Plan.from_dict(data), r["shape"])
        rows.append({"record": r["record"], "shape": r["shape"], "tokens_per_step": r["tokens_per_step"],
                     "budget_bytes": r["budget_bytes"], "device_name": r.get("device_name"),
                     "ran_commit": r.get("git_commit"), "plan_sha256": r["plan_sha256"],
                     "predicted_before_bytes": r["predicted_peak_device_bytes"], "today_bytes": today,
                     "allocated_bytes": r["steps_peak_device_bytes"],
                     "reserved_bytes": r.get("steps_peak_device_reserved_bytes")})
        if today is not None:
            print(f"{r['record']} {r['shape']} {r['tokens_per_step']}: allocated "
                  f"{r['steps_peak_device_bytes'] / GiB:.2f} GiB, predicted "
                  f"{r['predicted_peak_device_bytes'] / GiB:.2f} before, {today / GiB:.2f} today", flush=True)
    return rows


def render(rows: list[dict]) -> str:
    def gib(n):
        return "–" if n is None else f"{n / GiB:.2f}"

    found = [row for row in rows if row["today_bytes"] is not None]
    table = [[row["shape"], f"{row['tokens_per_step']:,}", f"{row['budget_bytes'] / GiB:.1f}", row["device_name"],
              (row["ran_commit"] or "?")[:7], gib(row["allocated_bytes"]), gib(row["reserved_bytes"]),
              gib(row["predicted_before_bytes"]), gib(row["today_bytes"]), f"`{row['record']}`"] for row in found]

    def over(key):
        return [(row[key] - row["allocated_bytes"]) / GiB for row in found]

    summary = "".join(
        f" {name}: under the allocated peak on {sum(o < 0 for o in over(key))} of {len(found)}, "
        f"over it by {sorted(over(key))[len(found) // 2]:+.2f} GiB at the median ({min(over(key)):+.2f} to "
        f"{max(over(key)):+.2f})." for name, key in (("Predicted before the run", "predicted_before_bytes"),
                                                     ("Today's model", "today_bytes")) if found)
    return markdown_table(["shape", "tokens/step", "budget GiB", "card", "ran at", "allocated GiB", "reserved GiB",
                           "predicted before GiB", "today's model GiB", "record"], table) + "\n\n" + summary.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="*", default=[], help="folders holding the plans that ran (searched recursively)")
    p.add_argument("--out", help="the record to write")
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    rows = peak_rows(plan_files(args.plans))
    print(render(rows))
    if args.out:
        write_records(args.out, {**stamp, "command": "python " + " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
