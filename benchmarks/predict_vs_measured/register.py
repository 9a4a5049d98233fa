"""Predictions registered before their run. Each held-out point of a coming GPU call is solved here (no
GPU), its plan kept in registered/ (named by its sha256, without the explanation's timelines) and its
predicted step in a dated record, committed before anything runs. On the GPU machine each point runs
with its registered plan (the record holds each command); the single_gpu_throughput records then name
the plan's sha256, which ties each measurement to its registered prediction (run.py here and
benchmarks/README.md count them apart).

    python benchmarks/predict_vs_measured/register.py --hardware PROFILE_OR_PRESET --host-ram 110GiB \
        --out benchmarks/predict_vs_measured/results/DATE-registered-WHAT.json

POINTS are held out: shapes the step-fitted coefficients never saw (benchmarks/common/fit_set.py), at
token counts and budgets not measured before on the card.

An A/B twin of a registered plan, to run beside it: the same decisions but only some of its streamed
updates (the others on the CPU), its step predicted by the same model before it runs (one point):

    python benchmarks/predict_vs_measured/register.py --hardware PROFILE --points 1.7b:16384:8GiB \
        --twin-of registered/PLAN.json --keep 9 none --out results/DATE-registered-WHAT.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.cli import grad_norm, shape_hardware_arg  # noqa: E402
from benchmarks.common.fit_set import card_of, used_in_fitting  # noqa: E402
from benchmarks.common.model import MAX_GRAD_NORM, SHAPES, plan_graph_of  # noqa: E402
from benchmarks.common.profiles import with_adamw_beside_copies  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402
from benchmarks.predict_vs_measured.run import trimmed  # noqa: E402
from benchmarks.single_gpu_throughput.run import solve_point  # noqa: E402

import slidedp  # noqa: E402
from slidedp.costmodel.hardware import resolve_hardware  # noqa: E402
from slidedp.scheduler import replay  # noqa: E402

HERE = Path(__file__).resolve().parent
REGISTERED = HERE / "registered"
REPO = HERE.parents[1]
THROUGHPUT_RESULTS = REPO / "benchmarks" / "single_gpu_throughput" / "results"

# (shape, tokens per step, budget): clipping at 1.0, one-row micro-batches, 12 timed steps
POINTS = (
    ("1.7b", 8192, "8GiB"),
    ("1.7b", 32768, "16GiB"),
    ("llama3b", 4096, "12GiB"),
    ("llama3b", 32768, "24GiB"),
    ("llama8b", 8192, "24GiB"),
    ("llama8b", 16384, "40GiB"),
    ("8b", 16384, "40GiB"),
)


def register(points, hardware: str, host_ram: str | None, folder: Path = REGISTERED, steps: int = 12,
             precision: str = "bf16", max_grad_norm: float | None = MAX_GRAD_NORM,
             nonfinite: str = "skip", hardware_for: dict[str, str] | None = None, micro_rows: int | None = 1,
             again: bool = True) -> list[dict]:
    """Solve each point, keep its plan in `folder` as registered/<sha256[:16]>.json, and return a row a
    point: its prediction, its plan's sha256 and the command that runs it on a GPU machine (with
    `max_grad_norm`, None: no clipping, and `nonfinite` as the plan was solved for). `hardware_for`: a
    shape's own profile (e.g. its compiled blocks scaled by `slidedp calibrate --model`), else `hardware`.
    `micro_rows`: rows (sequences) per micro-batch, the tokens split into that many fewer micro-batches;
    None: the plan groups them (`group_rows`), and with `again` False a point whose grouping already ran on the
    card (`measured_before`) is left out, said on stderr. A point with no plan within its budgets is left out,
    said on stderr with the solver's reason; none fitting raises the first one's error."""
    rows, unfit = [], []
    for shape, tokens, budget in points:
        if tokens % (SHAPES[shape]["seq"] * (micro_rows or 1)):
            raise ValueError(f"{shape} at {tokens} tokens: not a whole number of {micro_rows}-row micro-batches "
                             f"of {SHAPES[shape]['seq']} tokens a row")
        hw = (hardware_for or {}).get(shape, hardware)
        try:
            plan = solve_point(shape, tokens, budget, hw, host_ram=host_ram, precision=precision,
                               max_grad_norm=max_grad_norm, nonfinite=nonfinite, micro_rows=micro_rows or 1,
                               group_rows=micro_rows is None)
        except slidedp.InfeasibleBudgetError as e:
            print(f"{shape}:{tokens}:{budget}: not registered, no plan fits: {e}", file=sys.stderr, flush=True)
            unfit.append(e)
            continue
        grouped = plan.workload.batch_size
        if not again and micro_rows is None and measured_before([(shape, tokens, budget)], hw, micro_rows=grouped):
            print(f"{shape}:{tokens}:{budget}: not registered, its plan's {grouped}-row micro-batches already ran on "
                  "the card (not held out; --again registers it anyway)", file=sys.stderr, flush=True)
            continue
        rows.append(registered_row(plan, (shape, tokens, budget), hw, folder, steps, max_grad_norm, nonfinite,
                                   grouped))
    if unfit and not rows:
        raise unfit[0]
    return rows


def measured_before(points, hardware: str, hardware_for: dict[str, str] | None = None, micro_rows: int = 1,
                    results: Path = THROUGHPUT_RESULTS) -> list[tuple[str, int, str]]:
    """The points (SHAPE, TOKENS, BUDGET) that slidedp already ran on the card their hardware describes (a
    record in `results` of the same shape, tokens per step, budget, rows per micro-batch and card, whatever
    its plan): not held out there."""
    ran = set()
    for path in Path(results).glob("*.json"):
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else ():
            if (isinstance(r, dict) and str(r.get("system", "")).startswith("slidedp") and r.get("budget_bytes")
                    and r.get("slidedp_micro_rows", 1) == micro_rows):
                ran.add((r.get("shape"), r.get("tokens_per_step"), r["budget_bytes"], r.get("device_name", "")))
    out = []
    for shape, tokens, budget in points:
        card = card_of(resolve_hardware((hardware_for or {}).get(shape, hardware), "cpu").name)
        budget_bytes = slidedp.Budget.parse(budget).device_bytes
        if any((s, t, b) == (shape, tokens, budget_bytes) and card in name for s, t, b, name in ran):
            out.append((shape, tokens, budget))
    return out


SAMPLE_TOKENS = tuple(range(4096, 65536 + 1, 4096))  # tokens per step that --sample draws from
SAMPLE_BUDGETS = ("6GiB", "8GiB", "10GiB", "12GiB", "14GiB", "16GiB", "20GiB", "24GiB", "28GiB", "32GiB", "36GiB",
                  "40GiB")


def sample_points(k: int, seed: int, shapes, hardware: str, hardware_for: dict[str, str] | None = None,
                  results: Path = THROUGHPUT_RESULTS, registrations: Path = HERE / "results") -> list[tuple[str, int, str]]:
    """`k` points drawn at random (random.Random(seed)) from `shapes` x SAMPLE_TOKENS x SAMPLE_BUDGETS, none
    run on the card before (measured_before) nor in an earlier registration: points not picked by hand."""
    import random

    taken = {(p["shape"], int(p["tokens_per_step"]), p["budget"]) for path in Path(registrations).glob("*-registered-*.json")
             for p in json.loads(path.read_text()).get("points", [])}
    grid = [(s, t, b) for s in shapes for t in SAMPLE_TOKENS for b in SAMPLE_BUDGETS if (s, t, b) not in taken]
    ran = set(measured_before(grid, hardware, hardware_for, results=results))
    return random.Random(seed).sample([pt for pt in grid if pt not in ran], k)


def register_twin(point, hardware: str, plan_file: str, streamed_updates, folder: Path = REGISTERED, steps: int = 12,
                  max_grad_norm: float | None = MAX_GRAD_NORM, nonfinite: str = "skip") -> dict:
    """The A/B twin of the plan in `plan_file` (a plan of `point`, solved under `hardware`) that streams only
    `streamed_updates` through the device (slidedp.scheduler.replay.twin), kept and registered as
    `register` keeps a solved plan."""
    shape = point[0]
    plan = slidedp.Plan.load(plan_file)
    if resolve_hardware(hardware, "cpu").name != plan.hardware["name"]:
        raise ValueError(f"{plan_file} was solved under {plan.hardware['name']!r}, not {hardware}")
    graph = plan_graph_of(plan, shape, device="cpu")
    twin = replay.twin(plan, graph, streamed_updates=streamed_updates,
                       why=f"edited: only {list(streamed_updates)} of {list(plan.streamed_updates)} kept "
                           f"(an A/B twin of {Path(plan_file).name}, register.py --twin-of)")
    return registered_row(twin, point, hardware, folder, steps, max_grad_norm, nonfinite)


def registered_row(plan, point, hardware: str, folder: Path, steps: int, max_grad_norm, nonfinite: str,
                   micro_rows: int = 1) -> dict:
    """Keep `plan` (of `point`, SHAPE, TOKENS, BUDGET) in `folder` as <sha256[:16]>.json and return its
    registration row: its prediction, its sha256 and the command that runs it on a GPU machine."""
    shape, tokens, budget = point
    folder.mkdir(parents=True, exist_ok=True)
    run_options = ("" if max_grad_norm == MAX_GRAD_NORM else f" --max-grad-norm {max_grad_norm or 'none'}") + (
        "" if nonfinite == "skip" else f" --nonfinite {nonfinite}") + (
        "" if micro_rows == 1 else f" --slidedp-micro-rows {micro_rows}")
    text = json.dumps(trimmed(plan.to_dict())).encode()
    sha = hashlib.sha256(text).hexdigest()
    path = folder / f"{sha[:16]}.json"
    path.write_bytes(text)
    rel = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    command = (f"python benchmarks/single_gpu_throughput/run.py --shape {shape} --tokens {tokens} --budget {budget} "
               f"--systems slidedp --steps {steps} --hardware {shlex.quote(str(hardware))} --plan {rel}"
               f"{run_options} --merge --out OUT.json")
    print(f"{shape} {tokens} {budget}: predicted {plan.predicted_step_time_s:.3f} s -> {rel}", flush=True)
    return {"shape": shape, "tokens_per_step": tokens, "budget": budget, "max_grad_norm": max_grad_norm,
            "nonfinite": nonfinite, "slidedp_micro_rows": micro_rows, "plan_file": str(rel), "plan_sha256": sha,
            "predicted_step_s": plan.predicted_step_time_s, "hardware": plan.hardware["name"],
            "fitted": used_in_fitting({"shape": shape}, plan.hardware["name"]), "command": command}


def derived_profile(hardware: str, record: str, folder: Path = REGISTERED / "profiles") -> str:
    """`hardware` (a preset or profile path) with the CPU AdamW's share beside copies that the in_step.py
    `record` measured (common/profiles.py), saved in `folder` for the runs to load; its path."""
    hw = with_adamw_beside_copies(hardware, record)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{Path(hardware).stem}-adamw-beside-copies-{hw.cpu_adamw_contended_fraction:.3f}.json"
    hw.save(path)
    return str(path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path)


def micro_rows_arg(text: str) -> int | None:
    """--micro-rows: a positive number of rows, or 'auto' (None: the plan groups them)."""
    if text == "auto":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise argparse.ArgumentTypeError(f"a positive number of rows or 'auto', got {text!r}")
    return rows


def point_arg(text: str) -> tuple[str, int, str]:
    """SHAPE:TOKENS:BUDGET (a benchmark shape of benchmarks/common/model.py, tokens per step, a budget)."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in SHAPES or not parts[1].isdigit() or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want SHAPE:TOKENS:BUDGET, SHAPE one of {', '.join(SHAPES)}")
    return parts[0], int(parts[1]), parts[2]


def layer_ids(text: str) -> tuple[int, ...]:
    """LAYER[,LAYER...] or 'none': layer ids."""
    if text == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated layer ids or 'none'") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", required=True, help="a preset name or a `slidedp calibrate` profile (JSON path)")
    p.add_argument("--hardware-for", nargs="+", type=shape_hardware_arg, default=[], metavar="SHAPE=PROFILE",
                   help="a shape's own profile in place of --hardware (`slidedp calibrate --model ... --step-fits`)")
    p.add_argument("--host-ram", help="host RAM of the machine that will run them (e.g. 110GiB)")
    p.add_argument("--out", required=True, help="the registration record (results/DATE-registered-WHAT.json)")
    p.add_argument("--points", nargs="+", type=point_arg, metavar="SHAPE:TOKENS:BUDGET",
                   help="the points to register (default: POINTS), e.g. 1.7b:16384:8GiB")
    p.add_argument("--max-grad-norm", type=grad_norm, default=MAX_GRAD_NORM,
                   help="clipping of every point (default 1.0); 'none': no clipping")
    p.add_argument("--nonfinite", choices=["skip", "stop"], default="skip",
                   help="every point's rule for a non-finite gradient (stop: the plan may update in place)")
    p.add_argument("--twin-of", metavar="PLAN", help="register A/B twins of this plan (of the one --points, "
                   "solved under --hardware), one for each --keep")
    p.add_argument("--keep", nargs="+", type=layer_ids, default=[()], metavar="LAYERS",
                   help="with --twin-of: the plan's streamed updates a twin keeps on the device, comma-separated "
                        "layer ids or 'none' (every one on the CPU; the default)")
    p.add_argument("--adamw-beside-copies", metavar="RECORD",
                   help="a cpu_adamw/in_step.py record: --hardware and each --hardware-for with the CPU AdamW's share "
                        "beside copies it measured (saved in registered/profiles/, which the runs load)")
    p.add_argument("--micro-rows", type=micro_rows_arg, default=1,
                   help="rows (sequences) per slidedp micro-batch of every point (default 1); 'auto': each point's "
                        "plan groups its rows as predicted fastest (slidedp's group_rows)")
    p.add_argument("--sample", type=int, metavar="K", help="register K points drawn at random from --sample-shapes x "
                   "4,096..65,536 tokens (steps of 4,096) x 6..40 GiB, none run on the card or registered before "
                   "(in place of --points); points the solver finds no plan for are left out")
    p.add_argument("--sample-shapes", nargs="+", choices=sorted(SHAPES), default=["1.7b", "llama3b", "8b", "llama8b"])
    p.add_argument("--seed", type=int, default=0, help="with --sample: the draw's seed")
    p.add_argument("--again", action="store_true",
                   help="register points slidedp already ran on the card (refused otherwise: not held out there)")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    if args.adamw_beside_copies:
        args.hardware = derived_profile(args.hardware, args.adamw_beside_copies)
        args.hardware_for = [(shape, derived_profile(hw, args.adamw_beside_copies)) for shape, hw in args.hardware_for]
    if args.sample is not None:
        if args.points or args.twin_of:
            p.error("--sample draws the points: not with --points or --twin-of")
        args.points = sample_points(args.sample, args.seed, args.sample_shapes, args.hardware, dict(args.hardware_for))
        print("drawn: " + " ".join(":".join(map(str, pt)) for pt in args.points), flush=True)
    if args.twin_of and len(args.points or ()) != 1:
        p.error("--twin-of needs exactly one --points (the plan's point)")
    if args.twin_of and args.micro_rows != 1:
        p.error("--micro-rows must be 1 with --twin-of (a twin takes its plan's workload)")
    again = [] if args.again or args.twin_of or args.micro_rows is None else measured_before(
        args.points or POINTS, args.hardware, dict(args.hardware_for), args.micro_rows)
    if again:
        p.error("already run on the card, so not held out: " + ", ".join(":".join(map(str, pt)) for pt in again)
                + " (--again registers them anyway)")
    stamp = commit_stamp(args.allow_dirty)
    if args.twin_of:
        rows = [register_twin(args.points[0], args.hardware, args.twin_of, keep, max_grad_norm=args.max_grad_norm,
                              nonfinite=args.nonfinite) for keep in args.keep]
    else:
        rows = register(args.points or POINTS, args.hardware, args.host_ram, max_grad_norm=args.max_grad_norm,
                        nonfinite=args.nonfinite, hardware_for=dict(args.hardware_for), micro_rows=args.micro_rows,
                        again=args.again)
    record = {**stamp, "command": "python " + " ".join(map(shlex.quote, sys.argv)),
              "registered_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(), "points": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
