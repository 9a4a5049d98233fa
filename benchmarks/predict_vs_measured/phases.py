"""Where a prediction went wrong: the compute the plan was predicted to need beside the pass it ran.

For every slidedp point of single_gpu_throughput predicted before its run whose plan is found (as in
run.py), the plan replayed under the hardware it holds gives the compute lane's busy time and the
instant of the step's first compute; the record's steady steps (`step_info`, the timed steps but the
first and the last) give the pass (`pass_s`: the forward and backward, with what it waited for the
previous step's updates, `wait_s`). A compute-bound point whose pass less its wait is longer than the
predicted compute ran its kernels slower than the model's block rate; a shorter one, faster (the pass
also holds copies and waits the compute lane does not count, so "pass - wait" over "compute" is an
upper bound of the compute's own error; where the steps say how long the host took to issue the blocks'
forwards and backwards, `block_issue_s`, a pass close to it was set by the host, or by a full launch
queue: the device's busy time in a profile tells which). Where the steps say how
long the CPU round of updates they waited on took (`update_s`: one rank, updates at the step boundary), it
is shown beside the replay's CPU lane, with the share of that lane's busy time during which the replay also runs copies both ways (`copies_share`:
the condition in which `slidedp calibrate` measures the AdamW's contended rate; 1 where the model's
charge of that rate for the whole round is exact).

    python benchmarks/predict_vs_measured/phases.py [--out results/DATE-phases.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.fit_set import prediction_rows  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table  # noqa: E402
from benchmarks.predict_vs_measured.run import RESULTS, plan_files  # noqa: E402

import slidedp  # noqa: E402
from slidedp.api import plan_graph  # noqa: E402
from slidedp.scheduler.replay import replay  # noqa: E402


def _intervals(events, lane: str) -> list[list[int]]:
    """The busy intervals of `lane` on rank 0, overlapping ones merged, in order."""
    out: list[list[int]] = []
    for start, end in sorted((e.start, e.end) for e in events if e.rank == 0 and e.lane == lane and e.end > e.start):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _overlap(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The intersection of two lists of merged, ordered intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append([lo, hi])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def copies_share(events) -> float | None:
    """The share of the CPU lane's busy time (rank 0) during which both copy lanes are busy too; None
    without CPU updates."""
    cpu = _intervals(events, "cpu_update")
    busy = sum(b - a for a, b in cpu)
    if not busy:
        return None
    both = _overlap(_intervals(events, "h2d"), _intervals(events, "d2h"))
    return sum(b - a for a, b in _overlap(cpu, both)) / busy


def phase_rows() -> list[dict]:
    plans, models, rows = plan_files([]), {}, []
    for r in prediction_rows(RESULTS):
        data, steps = plans.get(r.get("plan_sha256")), (r.get("step_info") or [])[2:-1]
        if data is None or not steps:
            continue
        plan = slidedp.Plan.from_dict(data)
        if r["shape"] not in models:
            models[r["shape"]] = bench.empty_model(r["shape"], dtype=torch.bfloat16, device="cpu")
        graph = plan_graph(models[r["shape"]], plan)
        sim = replay(plan, graph, record=True)
        wait, pass_s = (statistics.median(s[k] for s in steps) for k in ("wait_s", "pass_s"))
        rounds = [s["update_s"] for s in steps if s.get("update_s") is not None]
        issued = [s["block_issue_s"] for s in steps if s.get("block_issue_s")]  # records from before: none
        compute = sim.lane_busy["compute"] * sim.tick_s
        rows.append({"record": r["record"], "shape": r["shape"], "tokens_per_step": r["tokens_per_step"],
                     "budget_bytes": r["budget_bytes"], "preset": r["preset"], "fitted": r["fitted"],
                     "measured_median_s": r["median_step_s"], "predicted_s": r["predicted_step_s"],
                     "wait_s": wait, "pass_s": pass_s, "predicted_compute_s": compute,
                     "block_issue_s": statistics.median(issued) if issued else None,
                     "predicted_first_compute_s": sim.compute_starts[0] * sim.tick_s,
                     "update_s": statistics.median(rounds) if rounds else None,
                     "predicted_update_s": sim.lane_busy["cpu_update"] * sim.tick_s,
                     "copies_share": copies_share(sim.events),
                     "bound": max(sim.lane_busy, key=sim.lane_busy.get),
                     "vocab_streamed": [name for name, d in (("prologue", plan.decisions[0]),
                                                             ("epilogue", plan.decisions[-1]))
                                        if d.activation == "streamed"]})
    return rows


def render(rows: list[dict]) -> str:
    table = [[r["shape"], f"{r['tokens_per_step']:,}", f"{r['budget_bytes'] / 2**30:.1f}", r["bound"],
              ", ".join(r["vocab_streamed"]) or "–",
              f"{r['measured_median_s']:.3f} / {r['predicted_s']:.3f}", f"{r['wait_s']:.3f}",
              f"{r['pass_s'] - r['wait_s']:.3f}", f"{r['predicted_first_compute_s']:.3f}", f"{r['predicted_compute_s']:.3f}",
              f"{(r['pass_s'] - r['wait_s']) / r['predicted_compute_s']:.2f}",
              "–" if r.get("block_issue_s") is None else f"{r['block_issue_s']:.3f}",
              "–" if r.get("update_s") is None else f"{r['update_s']:.3f}", f"{r['predicted_update_s']:.3f}",
              "–" if r.get("copies_share") is None else f"{r['copies_share']:.2f}",
              "fitted" if r["fitted"] else "held out", f"`{r['record']}`"] for r in rows]
    return markdown_table(["shape", "tokens/step", "budget GiB", "busiest lane (predicted)", "vocabulary streamed",
                           "step s measured / predicted",
                           "wait s", "pass - wait s", "first compute s predicted", "compute s predicted",
                           "(pass - wait) / compute", "host issuing the blocks s", "CPU round s",
                           "CPU round s predicted",
                           "copies both ways in the CPU round (predicted share)",
                           "fit", "record"], table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the record to write")
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    rows = phase_rows()
    print(render(rows))
    if args.out:
        write_records(args.out, {**stamp, "command": "python " + " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
