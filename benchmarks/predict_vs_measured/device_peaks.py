"""Today's device-memory model on the plans that ran: each slidedp point of single_gpu_throughput with a
measured peak, its plan's decisions laid out again by today's cost model (`replay`: the footprint the
solver predicts, what the record's prediction was) and lowered again into a program (as `slidedp.compile`
lowers and checks it against the budget), beside the peak predicted before the run and the measured peaks,
allocated and reserved by the CUDA allocator over the timed steps.

    python benchmarks/predict_vs_measured/device_peaks.py \
        --out benchmarks/predict_vs_measured/results/DATE-device-peaks-in-hindsight.json

Plans are found by sha256 as run.py finds them (registered/, ran/ and --plans folders). A prediction
under the measured allocated peak would let the allocator run past the budget: the model is meant to stay
over it, by little. The program's peak is at most the footprint's (the program is built to stay within it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table  # noqa: E402
from benchmarks.predict_vs_measured.run import RESULTS, plan_files  # noqa: E402

import slidedp  # noqa: E402
import slidedp.api  # noqa: E402
from slidedp.backend.lowering.verify import verify_program  # noqa: E402
from slidedp.scheduler.replay import replay  # noqa: E402

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


def peak_bytes(plan: slidedp.Plan, shape: str) -> tuple[int, int]:
    """(today's footprint of the plan's decisions, the peak of the program today's code lowers it into),
    on a meta-device model of `shape`."""
    graph = bench.plan_graph_of(plan, shape)
    return replay(plan, graph).peak_bytes, verify_program(slidedp.api.lower_plan(graph, plan)).peak_device_bytes


def peak_rows(plans: dict[str, dict]) -> list[dict]:
    rows = []
    for r in measured_points():
        data = plans.get(r["plan_sha256"])
        today, program = (None, None) if data is None else peak_bytes(slidedp.Plan.from_dict(data), r["shape"])
        rows.append({"record": r["record"], "shape": r["shape"], "tokens_per_step": r["tokens_per_step"],
                     "budget_bytes": r["budget_bytes"], "device_name": r.get("device_name"),
                     "ran_commit": r.get("git_commit"), "plan_sha256": r["plan_sha256"],
                     "predicted_before_bytes": r["predicted_peak_device_bytes"], "today_bytes": today,
                     "program_bytes": program,
                     "allocated_bytes": r["steps_peak_device_bytes"],
                     "reserved_bytes": r.get("steps_peak_device_reserved_bytes")})
        if today is not None:
            print(f"{r['record']} {r['shape']} {r['tokens_per_step']}: allocated "
                  f"{r['steps_peak_device_bytes'] / GiB:.2f} GiB, predicted "
                  f"{r['predicted_peak_device_bytes'] / GiB:.2f} before, {today / GiB:.2f} today (program "
                  f"{program / GiB:.2f})", flush=True)
    return rows


def render(rows: list[dict]) -> str:
    def gib(n):
        return "–" if n is None else f"{n / GiB:.2f}"

    found = [row for row in rows if row["today_bytes"] is not None]
    table = [[row["shape"], f"{row['tokens_per_step']:,}", f"{row['budget_bytes'] / GiB:.1f}", row["device_name"],
              (row["ran_commit"] or "?")[:7], gib(row["allocated_bytes"]), gib(row["reserved_bytes"]),
              gib(row["predicted_before_bytes"]), gib(row["today_bytes"]), gib(row.get("program_bytes")),
              f"`{row['record']}`"] for row in found]

    def over(key):
        return sorted((row[key] - row["allocated_bytes"]) / GiB for row in found)

    columns = (("Predicted before the run", "predicted_before_bytes"), ("Today's model", "today_bytes"),
               ("Today's program", "program_bytes"))
    summary = " ".join(
        f"{name}: under the allocated peak on {sum(o < 0 for o in over(key))} of {len(found)}, over it by "
        f"{over(key)[len(found) // 2]:+.2f} GiB at the median ({over(key)[0]:+.2f} to {over(key)[-1]:+.2f})."
        for name, key in columns if found)
    header = ["shape", "tokens/step", "budget GiB", "card", "ran at", "allocated GiB", "reserved GiB",
              "predicted before GiB", "today's model GiB", "today's program GiB", "record"]
    return markdown_table(header, table) + "\n\n" + summary


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
