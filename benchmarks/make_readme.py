"""Rewrite the generated parts of the benchmark READMEs from the committed records: the tables of
benchmarks/README.md (between `<!-- tables:begin -->` and `<!-- tables:end -->`) and the list of
records of each study's README.md (between `<!-- results:begin -->` and `<!-- results:end -->`).

    python benchmarks/make_readme.py          # rewrite them
    python benchmarks/make_readme.py --check  # exit 1 if a README differs from what the records give

The READMEs are never edited by hand between those markers; tests/benchmarks/test_readme.py checks
that they match the records. Which record of a study is its current one is said here (CURRENT)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the repository root, for `benchmarks.common`
    sys.path.insert(0, str(HERE.parent))

from benchmarks.common.fit_set import (first_runs, prediction_rows, registered_before,  # noqa: E402
                                       registration_records, registrations, used_in_fitting, within_goal)
from benchmarks.common.tables import gib, markdown_table, num, replace_section  # noqa: E402

TABLES = ("<!-- tables:begin -->", "<!-- tables:end -->")
RESULTS = ("<!-- results:begin -->", "<!-- results:end -->")

# study: what it measures (one line). Every folder with a run.py is a study.
STUDIES = {
    "single_gpu_throughput": "slidedp against GPU-resident PyTorch, FSDP2 with CPU offload and DeepSpeed "
                             "ZeRO-Offload (ZeRO-2/3, CPU Adam), same model and "
                             "batches, one GPU (H200 unless a record names another): tokens/s, step time measured and predicted, peak memory",
    "multi_gpu_scaling": "slidedp's data parallelism over 1-8 GPUs of one host, per route, against FSDP2 "
                         "(CPU offload and GPU-resident): scaling efficiency, host memory",
    "long_context": "one 262,144-token sequence of the Qwen3-4B shape within a device budget "
                    "(records of single_gpu_throughput's run.py and diagnose_step's)",
    "predict_vs_measured": "today's cost model on the plans that ran (hindsight) beside the measured step and "
                           "the prediction made before the run",
    "diagnose_step": "where a step's time goes: overlapped and isolated steps, per-operation predictions, "
                     "profiler tables",
    "cpu_adamw": "the host's AdamW (numba kernel) against torch's fused and foreach AdamW, like for like: same "
                 "gradient dtype, with and without the bf16 copy, at 1, 4 and all threads",
    "block_rate": "one decoder block's forward + backward rate, attention (SDPA) apart from the rest",
    "block_memory": "one block's device memory, measured against what the planner charges; what a compiled block "
                    "saves and recomputes under an activation memory budget",
    "attention_backends": "SDPA backends (flash, cuDNN, memory-efficient) on the Qwen3-4B attention shape",
    "head_kernel": "the fused linear + cross-entropy head against the tiled and plain ones",
    "host_memory_ranks": "host memory of several ranks against one: the host state exists once",
    "known_plans": "plans for the configurations slidedp is known for (Qwen3-14B on 4 H100s, Qwen2.5-72B on 4 hosts "
                   "of 4 RTX 4090s, Qwen3-4B and 8B on 1-8 H200s), predicted step times, no GPU",
    "largest_shape": "the largest Qwen3 shape whose host state fits in the host's RAM",
    "gpu_streamed_step": "the streamed step's correctness against PyTorch, and its first throughput readings",
    "gpu_worker_path": "one rank through the worker-process path against in-process, on the GPU",
}
# the record each headline table is made from
CURRENT = {
    "single_gpu_throughput": "2026-12-06-every-peer-best-config-h100.json",
    "multi_gpu_scaling": "2026-12-04-one-gpu.json",
    "cpu_adamw": "2026-12-05-h100-host-16-cores.json",
    "predict_vs_measured": "2026-12-07-todays-model-in-hindsight.json",
    "block_rate": "2026-12-04-h200.json",
    "head_kernel": "2026-12-03-h200.json",
    "attention_backends": "2026-12-03-h200.json",
    "host_memory_ranks": "2026-12-03-56-blocks-min-budget.json",
    "largest_shape": "2026-12-03-h200-host.json",
    "block_memory": "2026-12-03-h200.json",
}


def load(study: str, name: str | None = None):
    return json.loads((HERE / study / "results" / (name or CURRENT[study])).read_text())


def table_single_gpu() -> str:
    from benchmarks.single_gpu_throughput.run import render_table

    return render_table(load("single_gpu_throughput"))


FAIR_BASELINE = "2026-12-05-fair-gpu-resident-baseline.json"


def table_fair_baseline() -> str:
    from benchmarks.single_gpu_throughput.run import render_table

    return render_table(load("single_gpu_throughput", FAIR_BASELINE))


ZERO3_BEST = "2026-12-07-zero3-best-config-h100.json"


def table_zero3_best() -> str:
    from benchmarks.single_gpu_throughput.run import render_table

    return render_table(load("single_gpu_throughput", ZERO3_BEST))


SMALL_BUDGETS = "*-small-budgets*.json"
# SlideFormer on the same machine kind, Qwen3-4B shape, no clipping: tokens/s and peak device GiB at each
# tokens per step (docs/design.md §6.2; measured by others, not run by this script)
SLIDEFORMER = {4096: (2191, 5.3), 16384: (8278, 6.7), 65536: (15649, 13.6)}


def table_small_budgets() -> str:
    rows = []
    for path in sorted((HERE / "single_gpu_throughput" / "results").glob(SMALL_BUDGETS)):
        for r in json.loads(path.read_text()):
            theirs, their_gib = SLIDEFORMER[r["tokens_per_step"]]
            if r.get("error"):  # a point that did not finish: said, not dropped
                rows.append([f"{r['tokens_per_step']:,}", "–", r.get("device_name", "?"), r.get("nonfinite", "skip"),
                             r["error"].split(" after")[0], f"{theirs:,} ({their_gib} GiB)", *["–"] * 5,
                             f"`{path.name}`"])
                continue
            rows.append([f"{r['tokens_per_step']:,}", num(r["budget_bytes"] / 2**30, ".1f"), r["device_name"],
                         r.get("nonfinite", "skip") + (", streamed gradients" if r.get("streamed_gradients") else ""),
                         num(r["tokens_per_s"], ",.0f"), f"{theirs:,} ({their_gib} GiB)",
                         num(r["tokens_per_s"] / theirs, ".2f") + "x", gib(r["peak_device_bytes"]),
                         gib(r["peak_device_reserved_bytes"]), f"{r['median_step_s']:.3f} / {r['predicted_step_s']:.3f}",
                         gib(r["peak_host_bytes"]), f"`{path.name}`"])
    return markdown_table(["tokens/step", "slidedp budget GiB", "card", "on a non-finite gradient", "slidedp tokens/s",
                           "SlideFormer tokens/s (docs/design.md §6.2, H200, not run here)", "ratio",
                           "peak allocated GiB", "peak reserved GiB", "step s median / predicted", "peak host GiB",
                           "record"], rows)


def table_multi_gpu() -> str:
    from benchmarks.multi_gpu_scaling.run import render_table, render_targets

    records = load("multi_gpu_scaling")
    return render_table(records) + "\n\n" + render_targets(records)


def table_cpu_adamw() -> str:
    d = load("cpu_adamw")
    if isinstance(d, dict):  # the like-for-like study (every case, both gradient dtypes, with and without the copy)
        from benchmarks.cpu_adamw.run import render_table

        return render_table(d)
    # earlier records: numba with a bf16 gradient against torch with an fp32 one
    rows = [[r["system"], r["threads"], f"{r['params']:,}", num(r["gparams_per_s"], ".2f"),
             num(r.get("ratio_vs_torch_fused"), ".2f") + "x"] for r in d]
    return markdown_table(["implementation", "threads", "parameters", "G params/s", "vs torch fused"], rows)


def table_block_rate() -> str:
    d = load("block_rate")
    rows = [[f"{r['seq']:,}", num(r["block_flops_per_s"] / 1e12, ".0f"), num(r["sdpa_fwd_bwd_flops_per_s"] / 1e12, ".0f"),
             num(r["rest_flops_per_s"] / 1e12, ".0f"), num(r["block_fwd_bwd_s"] * 1e3, ".1f")] for r in d["rows"]]
    return f"{d['device']}, torch {d['torch']}:\n\n" + markdown_table(
        ["seq", "block TFLOP/s", "SDPA fwd+bwd TFLOP/s", "rest TFLOP/s", "block fwd+bwd ms"], rows)


def table_attention() -> str:
    d = load("attention_backends")
    rows = [[a["backend"], a["gqa"], a.get("error") or num(a.get("fwd_bwd_ms"), ".2f"), num(a.get("tflops"), ".0f"),
             num(a.get("grad_rel_err"), ".1e")] for a in d["attention"]]
    return f"{d['device']}, {d['rows']} x {d['seq']:,} tokens:\n\n" + markdown_table(
        ["backend", "GQA", "fwd+bwd ms", "TFLOP/s", "grad rel. error vs fp32"], rows)


def table_head_kernel() -> str:
    d = load("head_kernel")
    rows = [[r["system"], num(r["seconds"] * 1e3, ".1f"), num(r["tflops_per_s"], ".0f"), gib(r.get("peak_extra_bytes")),
             num(r.get("grad_hidden_rel_err"), ".1e")] for r in d["records"]]
    return f"{d['device']}, {d['tokens']:,} tokens, hidden {d['hidden']:,}, vocab {d['vocab']:,}:\n\n" + markdown_table(
        ["head", "ms", "TFLOP/s", "extra device GiB", "grad rel. error"], rows)


def table_host_memory_ranks() -> str:
    d = load("host_memory_ranks")
    rows = [[r["world_size"], f"{r['params']:,}", gib(r["host_state_bytes"]), gib(r["pss_bytes_total"]),
             num(r["ratio_to_first"], ".3f")] for r in d["records"]]
    return f"{d['hardware']}:\n\n" + markdown_table(
        ["ranks", "parameters", "host state GiB", "PSS of all processes GiB", "vs 1 rank"], rows)


def table_largest_shape() -> str:
    d = load("largest_shape")
    rows = [[s["shape"], f"{s['params']:,}", gib(s["host_state_bytes"]), "yes" if s["fits"] else "no"]
            for s in d["shapes"]]
    return f"Host RAM available: {gib(d['available_host_bytes'])} GiB; largest: {d['largest']}.\n\n" + markdown_table(
        ["Qwen3 shape", "parameters", "host state GiB", "fits"], rows)


def table_block_memory() -> str:
    rows = [[f"{r['seq']:,}", gib(r["charged_bytes"]), gib(r["peak_bytes"]), num(r["measured_over_charged"], ".2f")]
            for r in load("block_memory")]
    return markdown_table(["seq", "charged GiB", "measured peak GiB", "measured / charged"], rows)


def table_predictions() -> str:
    """The points predicted before their run; beside each, today's model on the plan it ran (the
    current predict_vs_measured record: hindsight, not a prediction)."""
    rows = prediction_rows(HERE / "single_gpu_throughput" / "results")
    replays = load("predict_vs_measured")
    def key(r):  # one run: a record may hold one point run twice (another plan, e.g. another micro-batching)
        return r["record"], r.get("measure_start_utc"), r["shape"], r["tokens_per_step"], r["budget_bytes"]
    replayed = {key(r): r for r in replays["rows"]}
    if len(replayed) != len(replays["rows"]):
        raise ValueError(f"{CURRENT['predict_vs_measured']}: two replayed runs share a key {key.__name__}() tells apart")
    names = sorted({name for r in replays["rows"] for name in r.get("profile_s", {})})
    table, unders, profile_notes = [], [], []
    firsts = {id(r) for r in first_runs(rows)}
    for r in rows:
        again = replayed.get(key(r), {})
        t = r["today_s"] = again.get("today_s")
        under = [again.get("profile_s", {}).get(name) for name in names]
        unders.append(under)
        table.append([r["shape"], f"{r['tokens_per_step']:,}", num(r["budget_bytes"] / 2**30, ".1f"),
                      "none" if r.get("max_grad_norm") is None else num(r["max_grad_norm"], ".1f"), r["device_name"],
                      r["preset"], (r["git_commit"] or "?")[:7], f"{r['predicted_step_s']:.3f}",
                      f"{r['median_step_s']:.3f}",
                      f"{r['error_pct']:+.1f}%",
                      *("–" if s is None else f"{s:.3f} ({100 * (r['median_step_s'] / s - 1):+.1f}%)"
                        for s in (t, *under)),
                      ("fitted" if r["fitted"] else "held out") + ("" if id(r) in firsts else ", a repeat"),
                      f"`{r['record']}`"])
    held = [r for r in rows if not r["fitted"] and id(r) in firsts]
    within = sum(within_goal(r["median_step_s"], r["predicted_step_s"]) for r in held)
    share = (f"{within} of {len(held)} held-out points within 10% (goal: 80%; each plan counted once, at its "
             f"first run: {len(rows) - len(firsts)} later runs of a plan are marked a repeat)"
             if held else "no held-out point")
    registered = registrations(HERE / "predict_vs_measured" / "results")
    ahead = [r for r in held if registered_before(r, registered)]
    if registered:
        right = sum(within_goal(r["median_step_s"], r["predicted_step_s"]) for r in ahead)
        share += (f"; of those whose prediction was registered and committed before the run "
                  f"(`predict_vs_measured/register.py`), {right} of {len(ahead)}")
        days = {}  # registration day -> (within, points): how the model registered on each day fared
        for r in ahead:
            day = days.setdefault(registered[r["plan_sha256"]][:10], [0, 0])
            day[0] += within_goal(r["median_step_s"], r["predicted_step_s"])
            day[1] += 1
        share += " (by the day registered: " + ", ".join(f"{d}: {w} of {n}" for d, (w, n) in sorted(days.items())) + ")"
    replayed = [r for r in held if r["today_s"] is not None]
    unders = [u for r, u in zip(rows, unders) if id(r) in firsts]
    rows = [r for r in rows if id(r) in firsts]
    hindsight = sum(within_goal(r["median_step_s"], r["today_s"]) for r in replayed)
    for i, name in enumerate(names):
        on = [(r, u[i]) for r, u in zip(rows, unders) if u[i] is not None and not used_in_fitting(r, name)]
        profile_notes.append(f"; under `{name}`, on the held-out points of its card: "
                             f"{sum(within_goal(r['median_step_s'], s) for r, s in on)} of {len(on)}")
    return markdown_table(["shape", "tokens/step", "budget GiB", "clip", "card", "preset", "commit",
                           "predicted s", "measured median s", "error",
                           "today's model s (error), hindsight", *(f"`{n}` s (error), hindsight" for n in names),
                           "preset fitted on it", "record"],
                          table) + "\n\n" + share + (
        f". Today's model on the same plans (hindsight, `predict_vs_measured/results/{CURRENT['predict_vs_measured']}`, "
        f"commit {replays['git_commit'][:7]}): {hindsight} of {len(replayed)}" + "".join(profile_notes)
        if replayed else "") + "."


def table_host_predictions() -> str:
    """The points whose plan was also predicted with the host that ran them, measured by the same benchmark invocation
    before the run (`slidedp calibrate --host-only`): that prediction beside the registered one."""
    rows, right, regs = [], 0, 0
    for r in first_runs(prediction_rows(HERE / "single_gpu_throughput" / "results")):
        host_s = r.get("host_predicted_step_s")
        if host_s is None:
            continue
        measured, fields = r["median_step_s"], r["host_fields"]
        right += within_goal(measured, host_s)
        regs += within_goal(measured, r["predicted_step_s"])
        rows.append([r["shape"], f"{r['tokens_per_step']:,}", num(r["budget_bytes"] / 2**30, ".1f"),
                     num(fields["cpu_adamw_params_per_s"] / 1e9, ".2f"), num(fields["cpu_adamw_contended_fraction"], ".3f"),
                     f"{(fields['host_compiled_fwd_s'] + fields['host_compiled_bwd_s']) * 1e3:.2f}",
                     f"{measured:.3f}", f"{r['predicted_step_s']:.3f} ({r['error_pct']:+.1f}%)",
                     f"{host_s:.3f} ({100 * (measured / host_s - 1):+.1f}%)", f"`{r['record']}`"])
    if not rows:
        return "No record holds a prediction with its host measured before its run."
    return markdown_table(["shape", "tokens/step", "budget GiB", "host CPU AdamW G params/s", "beside copies",
                           "host ms to issue a block (fwd + bwd)", "measured median s", "registered s (error)",
                           "host re-measured s (error)", "record"], rows) + (
        f"\n\nWithin 10%: {regs} of {len(rows)} with the registered prediction, {right} of {len(rows)} with the "
        "host re-measured before the run.")


def table_registrations() -> str:
    """Per registration record: its points, those measured (each plan's first run after the registration)
    and how many of the held-out ones came within 10% of their registered prediction."""
    rows = first_runs(prediction_rows(HERE / "single_gpu_throughput" / "results"))
    out = []
    for name, record in sorted(registration_records(HERE / "predict_vs_measured" / "results"),
                               key=lambda nr: nr[1]["registered_utc"]):
        when = record["registered_utc"]
        shas = {p["plan_sha256"] for p in record["points"]}
        ran = [r for r in rows if r.get("plan_sha256") in shas and when < r.get("measure_start_utc", "")]
        held = [r for r in ran if not r["fitted"]]
        right = sum(within_goal(r["median_step_s"], r["predicted_step_s"]) for r in held)
        errors = ", ".join(f"{r['error_pct']:+.1f}%" for r in sorted(held, key=lambda r: r["measure_start_utc"]))
        out.append([f"`{name}`", when[:16].replace("T", " "), (record.get("git_commit") or "?")[:7],
                    str(len(record["points"])), str(len(ran)), str(len(held)),
                    f"{right} of {len(held)}" if held else "–", errors or "–"])
    return markdown_table(["registration", "registered (UTC)", "commit", "points", "run", "held out run",
                           "held out within 10%", "held-out errors, in run order"], out)


BEFORE_CAPACITY = "5e69562"  # the tree before the host layout, the placement and the streamed tables
NO_REGRESSION = "*-no-regression-*.json"  # records of both trees, one call each
HOST_PREDICTED = "the records of `{study}/results/` with `host_predicted_step_s` (run.py --host-calibration)"
PREDICTED_BEFORE = "every record of `{study}/results/` whose prediction was fixed before its run (`predicted_utc`)"
REGISTERED = ("the registration records `{study}/results/*-registered-*.json` (`predict_vs_measured/register.py`) "
              "and the records of single_gpu_throughput that ran their plans")


def table_no_regression() -> str:
    """Per no-regression record (both trees in one call on one card): each point's median step today
    against the tree before the capacity work (its steady median computed here by the harness's rule:
    that tree's records do not hold it), and today's speed as a multiple of it (goal >= 0.97)."""
    from benchmarks.common.steady import steady_fields

    rows = []
    for path in sorted((HERE / "single_gpu_throughput" / "results").glob(NO_REGRESSION)):
        median = {}
        for r in json.loads(path.read_text()):
            side = "before" if r["git_commit"] == BEFORE_CAPACITY else "today"
            median.setdefault((r["tokens_per_step"], r["budget_bytes"]), {})[side] = (
                steady_fields(r["step_times_s"], r["tokens_per_step"])["median_step_s"], r)
        for (tokens, budget), sides in median.items():
            if len(sides) < 2:
                continue
            (before_s, _), (today_s, today) = sides["before"], sides["today"]
            ratio = before_s / today_s
            rows.append([f"{tokens:,}", num(budget / 2**30, ".0f"), today["device_name"], f"{before_s:.3f}",
                         f"{today_s:.3f} ({today['git_commit']})", f"{ratio:.3f}x",
                         "met" if ratio >= 0.97 else "not met", f"`{path.name}`"])
    return markdown_table(["tokens/step", "budget GiB", "card", f"before ({BEFORE_CAPACITY}) s", "today s",
                           "today's speed / before", "within 3%", "record"], rows)


HEADLINES = [  # (title, study, records, table); records None: the study's CURRENT one
    ("Single GPU: every system on one machine, Qwen3-4B shape, 16,384 tokens, one H100 (each offloading "
     "baseline in the micro-batch and checkpointing settings tried; ratios against its fastest)",
     "single_gpu_throughput", None, table_single_gpu),
    ("Single GPU: the GPU-resident baseline at its best configuration", "single_gpu_throughput", FAIR_BASELINE,
     table_fair_baseline),
    ("Single GPU: DeepSpeed ZeRO-3 + CPU offload at its best configuration (4-row micro-batches, every block "
     "checkpointed) beside slidedp, one H100 invocation", "single_gpu_throughput", ZERO3_BEST, table_zero3_best),
    ("Single GPU: the Qwen3-4B shape at SlideFormer's memory (no clipping)", "single_gpu_throughput", SMALL_BUDGETS,
     table_small_budgets),
    ("Single GPU: step times predicted before the run", "single_gpu_throughput", PREDICTED_BEFORE,
     table_predictions),
    ("Single GPU: each registration of predictions, before its runs", "predict_vs_measured", REGISTERED,
     table_registrations),
    ("Single GPU: predicted again with the host that ran, measured just before", "single_gpu_throughput",
     HOST_PREDICTED, table_host_predictions),
    ("Single GPU: no regression where the old layout fit", "single_gpu_throughput", NO_REGRESSION,
     table_no_regression),
    ("Multi-GPU scaling", "multi_gpu_scaling", None, table_multi_gpu),
    ("CPU AdamW", "cpu_adamw", None, table_cpu_adamw),
    ("One block's rate", "block_rate", None, table_block_rate),
    ("One block's memory", "block_memory", None, table_block_memory),
    ("Attention backends", "attention_backends", None, table_attention),
    ("Fused head", "head_kernel", None, table_head_kernel),
    ("Host memory of several ranks", "host_memory_ranks", None, table_host_memory_ranks),
    ("Largest shape", "largest_shape", None, table_largest_shape),
]


def records_of(study: str) -> list[Path]:
    return sorted((HERE / study / "results").glob("*.json"), reverse=True)


def record_command(path: Path) -> str | None:
    """The command a records file names (its first record's, or its meta's), if any."""
    try:
        d = json.loads(path.read_text())
    except ValueError:
        return None
    first = d[0] if isinstance(d, list) and d else d
    if not isinstance(first, dict):
        return None
    cmd = first.get("command") or (first.get("meta") or {}).get("command")
    return cmd[0] if isinstance(cmd, list) and cmd else cmd if isinstance(cmd, str) else None


def tables_section() -> str:
    lines = ["## Studies", ""]
    rows = []
    for study, what in STUDIES.items():
        newest = records_of(study)
        rows.append([f"[`{study}/`]({study}/README.md)", what,
                     f"`{newest[0].name}`" if newest else "–", len(newest)])
    lines.append(markdown_table(["study", "measures", "newest record", "records"], rows))
    for title, study, record, fn in HEADLINES:
        source = record.format(study=study) if record in (PREDICTED_BEFORE, REGISTERED, HOST_PREDICTED) else \
            f"`{study}/results/{record or CURRENT[study]}`"
        lines += ["", f"## {title}", "", f"From {source}.", "", fn()]
    return "\n".join(lines)


def results_section(study: str) -> str:
    lines = ["Records (newest first; `results/`):", ""]
    for path in records_of(study):
        cmd = record_command(path)
        lines.append(f"* `{path.name}`" + (f": `{cmd}`" if cmd else ""))
    return "\n".join(lines)


def expected() -> dict[Path, str]:
    """Every generated README as it should read, by path."""
    out = {}
    top = HERE / "README.md"
    out[top] = replace_section(top.read_text(), tables_section(), *TABLES)
    for study in STUDIES:
        path = HERE / study / "README.md"
        out[path] = replace_section(path.read_text(), results_section(study), *RESULTS)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check; exit 1 if a README is not what it should be")
    args = p.parse_args(argv)
    stale = []
    for path, text in expected().items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print("not generated from the records: " + ", ".join(str(p.relative_to(HERE)) for p in stale)
              + " (run python benchmarks/make_readme.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
