"""Today's cost model on the plans that ran: each slidedp point of single_gpu_throughput whose step
was predicted before its run, its plan simulated again (`slidedp.predict`) under today's version of
the preset it was solved with, beside the measured median step and the prediction made before the run.

    python benchmarks/predict_vs_measured/run.py --plans DIR [DIR ...] --save-plans \
        --profiles results/DATE-h100-calibrated-profile.json \
        --out benchmarks/predict_vs_measured/results/DATE-todays-model-in-hindsight.json

A record's plan is the file whose sha256 the record names (`plan_sha256`), looked for in the --plans
folders, in registered/ (register.py) and in ran/ beside this script (copies without the explanation's
timelines, which the replay does not read; `--save-plans` writes them there, so the record can be
checked from the repository).
Each plan is also replayed under the hardware it holds: that must give the prediction the record
made before its run (`own_s`), or the replay is not the model that made it. Points whose plan is not
found are listed as such. With --profiles (the JSON of `slidedp calibrate` on a card, with or without
`--step-fits`), the points that ran on that card are also replayed under each: what the cost model
says of the same decisions given that profile instead of the preset. With --profile-for SHAPE=PROFILE
(`slidedp calibrate --model M --step-fits ...`: the fitted block rate scaled to M's block), a shape's
points on that profile's card are replayed under it, all such profiles in one column, PER_SHAPE.

This is hindsight, not prediction: the cost model changed after these runs, and a change may have
been motivated by one of them (benchmarks/LOG.md says what motivated each). The goal of predictions
within 10% on 80% of held-out points counts only predictions fixed before the run
(benchmarks/README.md); this table says whether today's model would have done better on the
same decisions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.cli import shape_hardware_arg  # noqa: E402
from benchmarks.common.fit_set import card_of, first_runs, prediction_rows, used_in_fitting, within_goal  # noqa: E402
from benchmarks.common.profiles import with_adamw_beside_copies, with_compiled_host_floor  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table  # noqa: E402

import slidedp  # noqa: E402
from slidedp.costmodel.hardware import PRESETS  # noqa: E402

HERE = Path(__file__).resolve().parent
SAVED = HERE / "ran"
REGISTERED = HERE / "registered"
BULK = ("timeline", "memory_timeline", "groups", "alternatives", "critical_path")
RESULTS = HERE.parent / "single_gpu_throughput" / "results"
PER_SHAPE = "each shape's own profile"  # the column of --profile-for


def plan_files(folders) -> dict[str, dict]:
    """sha256 of a plan's JSON bytes -> the plan (as a dict): the --plans folders' *.json files, and the
    copies kept in ran/ (each under the sha256 of the file it was made from)."""
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.json")):
            data = path.read_bytes()
            found.setdefault(hashlib.sha256(data).hexdigest(), json.loads(data))
    for path in sorted(SAVED.glob("*.json")):
        kept = json.loads(path.read_text())
        found.setdefault(kept["plan_sha256"], kept["plan"])
    for path in sorted(REGISTERED.glob("*.json")):  # registered plans (register.py), under their file's sha256
        data = path.read_bytes()
        found.setdefault(hashlib.sha256(data).hexdigest(), json.loads(data))
    return found


def trimmed(plan: dict) -> dict:
    """A plan (as a dict) without what neither a replay nor a run reads: the explanation's timelines,
    groups and alternatives (four fifths of the bytes)."""
    return {**plan, "explanation": {k: v for k, v in plan["explanation"].items() if k not in BULK}}


def keep(sha256: str, plan: dict) -> None:
    """A trimmed copy of a plan that ran in ran/, under the sha256 of its file."""
    SAVED.mkdir(exist_ok=True)
    (SAVED / f"{sha256[:16]}.json").write_text(json.dumps({"plan_sha256": sha256, "plan": trimmed(plan)}) + "\n")


def replay_rows(plans: dict[str, dict], save: bool = False, profiles=(), profile_for=None,
                adamw_beside_copies: str | None = None, host_floor_s: tuple[float, float] | None = None) -> list[dict]:
    """A row per point predicted before its run: the measured median, the prediction, the plan replayed
    under the hardware it holds (own_s), under today's preset (today_s; for a calibrated profile, the one
    it holds) and under each given profile of the card it ran on (profile_s: {profile name: seconds};
    `profile_for`, {shape: profile}: under PER_SHAPE, its shape's). `adamw_beside_copies` (a cpu_adamw/in_step.py
    record): every given profile with the AdamW's share beside copies it measured (common/profiles.py);
    `host_floor_s` (forward, backward seconds): every given profile with that compiled-block host floor."""
    def load(path):
        hw = slidedp.Hardware.load(path)
        hw = hw if adamw_beside_copies is None else with_adamw_beside_copies(hw, adamw_beside_copies)
        return hw if host_floor_s is None else with_compiled_host_floor(hw, *host_floor_s)

    profiles = [load(path) for path in profiles]
    own_profile = {shape: load(path) for shape, path in (profile_for or {}).items()}
    models = {}
    rows = []
    for r in prediction_rows(RESULTS):
        row = {"record": r["record"], "shape": r["shape"], "tokens_per_step": r["tokens_per_step"],
               "budget_bytes": r["budget_bytes"], "max_grad_norm": r.get("max_grad_norm"),
               "device_name": r["device_name"], "preset": r["preset"], "ran_commit": r["git_commit"],
               "plan_sha256": r.get("plan_sha256"), "measure_start_utc": r.get("measure_start_utc"),
               "measured_median_s": r["median_step_s"],
               "predicted_before_s": r["predicted_step_s"], "fitted": r["fitted"]}
        data = plans.get(r.get("plan_sha256"))
        if data is None:
            rows.append({**row, "own_s": None, "today_s": None, "profile_s": {}})
            continue
        if save:
            keep(r["plan_sha256"], data)
        plan = slidedp.Plan.from_dict(data)
        if r["shape"] not in models:
            models[r["shape"]] = bench.empty_model(r["shape"], dtype=torch.bfloat16, device="cpu")
        model = models[r["shape"]]
        own = slidedp.predict(model, plan)
        # a preset as today's code defines it; a calibrated profile is the one the plan holds
        today = slidedp.predict(model, plan, hardware=r["preset"]) if r["preset"] in PRESETS else own
        on_card = {h.name: slidedp.predict(model, plan, hardware=h) for h in profiles
                   if card_of(h.name) in r["device_name"]}
        shape_hw = own_profile.get(r["shape"])
        if shape_hw is not None and card_of(shape_hw.name) in r["device_name"]:
            on_card[PER_SHAPE] = slidedp.predict(model, plan, hardware=shape_hw)
        rows.append({**row, "own_s": own, "today_s": today, "profile_s": on_card})
        print(f"{r['record']} {r['shape']} {r['tokens_per_step']}: measured {r['median_step_s']:.3f} s, "
              f"before the run {r['predicted_step_s']:.3f}, replayed {own:.3f}, today's model {today:.3f}"
              + "".join(f", {name} {s:.3f}" for name, s in on_card.items()), flush=True)
    return rows


def render(rows: list[dict]) -> str:
    """The table, a row a point, and the share of held-out points within 10%: before the run, with
    today's model on the same plans, and under each profile on the points of its card; each plan counted
    once, at its first run (fit_set.first_runs)."""
    def err(seconds, row):
        return 100 * (row["measured_median_s"] / seconds - 1)

    def cell(seconds, row):
        return "–" if seconds is None else f"{seconds:.3f} ({err(seconds, row):+.1f}%)"

    names = sorted({name for row in rows for name in row.get("profile_s", {})})
    table = []
    for row in rows:
        table.append([row["shape"], f"{row['tokens_per_step']:,}", f"{row['budget_bytes'] / 2**30:.1f}",
                      row["device_name"], row["preset"], (row["ran_commit"] or "?")[:7],
                      f"{row['measured_median_s']:.3f}", cell(row["predicted_before_s"], row),
                      "plan not found" if row["today_s"] is None else cell(row["today_s"], row),
                      *(cell(row.get("profile_s", {}).get(name), row) for name in names),
                      "fitted" if row["fitted"] else "held out", f"`{row['record']}`"])
    counted = first_runs(rows)
    held = [row for row in counted if not row["fitted"]]
    replayed = [row for row in held if row["today_s"] is not None]

    def within(seconds_of, among):
        return sum(within_goal(row["measured_median_s"], seconds_of(row)) for row in among)
    share = (f"Held-out points within 10%: {within(lambda r: r['predicted_before_s'], replayed)} of {len(replayed)} "
             f"as predicted before the run; {within(lambda r: r['today_s'], replayed)} of {len(replayed)} with "
             "today's model on the same plans (hindsight)."
             + (f" {len(held) - len(replayed)} held-out point(s) without their plan." if len(replayed) < len(held)
                else ""))
    for name in names:  # held out for the profile: its own fit set (a profile with step fits has one)
        on = [row for row in counted if name in row.get("profile_s", {}) and not used_in_fitting(row, name)]
        share += (f" Under `{name}`, on the {len(on)} held-out points of its card: "
                  f"{within(lambda r: r['profile_s'][name], on)} (before the run: "
                  f"{within(lambda r: r['predicted_before_s'], on)}; hindsight).")
    return markdown_table(["shape", "tokens/step", "budget GiB", "card", "preset", "ran at", "measured median s",
                           "predicted before the run s (error)", "today's model s (error)",
                           *(f"`{name}` s (error)" for name in names), "preset fitted on it", "record"],
                          table) + "\n\n" + share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", nargs="*", default=[], help="folders holding the plans that ran (searched recursively)")
    p.add_argument("--save-plans", action="store_true", help="keep a copy of every plan found in ran/")
    p.add_argument("--profiles", nargs="*", default=[],
                   help="`slidedp calibrate` profiles: each card's points are also replayed under its own")
    p.add_argument("--profile-for", nargs="+", type=shape_hardware_arg, default=[], metavar="SHAPE=PROFILE",
                   help=f"a shape's own profile: its points on that card also replayed under it ({PER_SHAPE!r})")
    p.add_argument("--adamw-beside-copies", metavar="RECORD",
                   help="a cpu_adamw/in_step.py record: the given profiles with the fraction of the CPU AdamW's rate "
                        "it measured beside copies both ways, as `slidedp calibrate` measures it now")
    p.add_argument("--compiled-host-floor-ms", nargs=2, type=float, metavar=("FWD", "BWD"),
                   help="what-if: the given profiles with this host floor of a compiled block, per micro-batch "
                        "(slidedp calibrate measures it since; profiles made before it have none)")
    p.add_argument("--out", help="the record to write")
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    rows = replay_rows(plan_files(args.plans), save=args.save_plans, profiles=args.profiles,
                       profile_for=dict(args.profile_for), adamw_beside_copies=args.adamw_beside_copies,
                       host_floor_s=None if args.compiled_host_floor_ms is None
                       else tuple(ms / 1e3 for ms in args.compiled_host_floor_ms))
    bad = [row for row in rows if row["own_s"] is not None
           and abs(row["own_s"] / row["predicted_before_s"] - 1) > 1e-6]
    for row in bad:
        print(f"WARNING {row['record']} {row['shape']} {row['tokens_per_step']}: replayed under its own hardware "
              f"{row['own_s']:.6f} s, the run predicted {row['predicted_before_s']:.6f}", file=sys.stderr)
    print(render(rows))
    if args.out:
        write_records(args.out, {**stamp, "command": "python " + " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
