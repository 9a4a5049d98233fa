"""benchmarks/single_gpu_throughput end to end on the CPU: a tiny Qwen3, each system's point in its own child
process, records collected into JSON and rendered as the README table.

The default run covers slidedp and GPU-resident PyTorch (about 20 s, mostly the children importing
torch, transformers and slidedp); FSDP2 with CPU offload (gloo on the CPU) adds a third child, so its
test is marked slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.single_gpu_throughput.run as bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "single_gpu_throughput" / "run.py"


def load_script():
    return bench_module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    return (tmp, *run_smoke(tmp / "records.json", "slidedp", "gpu_resident"))


def run_smoke(out: Path, *systems: str, merge: bool = False, extra: list[str] = ()):
    cmd = [sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--tokens", "64",
           "--systems", *systems, "--steps", "3", "--timeout-s", "120", "--out", str(out), "--allow-dirty",
           *extra]
    proc = subprocess.run(cmd + (["--merge"] if merge else []), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def check_record(bench, r: dict) -> None:
    assert r["error"] is None, (r["system"], r["error"], r.get("traceback"))
    missing = [k for k in bench.REQUIRED_KEYS if k not in r]
    assert not missing, (r["system"], missing)
    assert r["tokens_per_step"] == 64 and r["micro_batches"] == 2 and r["device"] == "cpu"
    # 3 timed steps: the mean of all of them, and one steady step (the first and the final flush aside)
    times = r["step_times_s"]
    assert len(times) == 3 and r["measured_step_s"] == pytest.approx(sum(times) / 3)
    assert r["steady_steps"] == 1 and r["median_step_s"] == r["mean_step_s"] == times[1] > 0
    assert r["tokens_per_s"] == pytest.approx(64 / r["median_step_s"])
    assert r["few_steps"] is True and "the first left out" in r["steady_rule"]
    assert r["peak_host_bytes"] > 0 and r["host_used_bytes"] is not None
    assert r["peak_device_bytes"] is None  # no device memory on the CPU
    assert r["cuda_expandable_segments"] is False  # every system's allocator is set alike; none on the CPU
    assert len(r["losses"]) == 4
    assert "single_gpu_throughput/run.py" in r["command"] and len(r["date"]) == 10
    assert len(r["git_commit"]) == 40 and isinstance(r["dirty"], bool)


def test_every_system_writes_a_complete_record(smoke):
    tmp, records, _ = smoke
    bench = load_script()
    assert [r["system"] for r in records] == ["slidedp", "gpu_resident"]
    for r in records:
        check_record(bench, r)
    slide = records[0]
    assert slide["predicted_step_s"] > 0 and slide["budget_bytes"] == 40 * 2**30
    assert "slidedp plan" in slide["plan_summary"]
    # the prediction was fixed before the timed steps, from the plan file named by its hash
    assert slide["predicted_utc"] < slide["measure_start_utc"] and len(slide["plan_sha256"]) == 64
    assert (tmp / "plans" / "qwen3_tiny_64.json").is_file()
    # slidedp's build, phase by phase (on the CPU nothing is pinned and the rank is in this process)
    phases = slide["build_phases_s"]
    assert {"traced", "planned", "lowered", "host state allocated", "weights written", "rank built"} <= set(phases)
    assert "host state pinned" not in phases and 0 < sum(phases.values()) <= slide["build_s"]
    assert records[1]["build_phases_s"] == {}
    assert records[1]["predicted_step_s"] is None and records[1]["budget_bytes"] is None
    # the baseline's best configuration: on the CPU every probe fits, so no block is checkpointed
    base = records[1]
    assert base["checkpointed_blocks"] == 0 and base["checkpoint_probes"] and base["compiled_blocks"] is False


def test_two_row_micro_batches_train_the_same_step(smoke, tmp_path):
    """--slidedp-micro-rows 2: one micro-batch of both rows (batch_size 2), the same losses."""
    records, _ = run_smoke(tmp_path / "rows2.json", "slidedp", extra=["--slidedp-micro-rows", "2"])
    r = records[0]
    assert r["error"] is None and r["slidedp_micro_rows"] == 2 and "1 micro-batch(es) x 2 x" in r["plan_summary"]
    same_training([smoke[1][0], r])


def test_a_baseline_at_several_micro_batch_sizes_in_one_run(smoke, tmp_path):
    """--baseline-micro-rows 1 2: the baseline runs once per size, each a record of its own (slidedp once),
    each training the same step; the table names the size and the checkpointing asked for is recorded."""
    records, stdout = run_smoke(tmp_path / "several.json", "slidedp", "gpu_resident",
                                extra=["--baseline-micro-rows", "1", "2", "--baseline-checkpoint", "all"])
    assert sorted((r["system"], r["baseline_micro_rows"]) for r in records) == [
        ("gpu_resident", 1), ("gpu_resident", 2), ("slidedp", 1)]
    assert all(r["error"] is None for r in records)
    assert {r["checkpoint_setting"] for r in records if r["system"] == "gpu_resident"} == {"all"}
    assert next(r for r in records if r["system"] == "slidedp")["checkpoint_setting"] is None
    assert "| GPU-resident (2-row micro-batches, " in stdout
    same_training([smoke[1][0], *records])


def same_training(records: list[dict]) -> None:
    first = [r["losses"][0] for r in records]  # step 1: same initial weights, same batch
    assert max(first) - min(first) <= 1e-5 * abs(first[0]), first
    second = [r["losses"][1] for r in records]  # same AdamW, clipping and loss weighting: same step 2 (fp32)
    assert max(second) - min(second) <= 1e-4 * abs(second[0]), second


def test_nonfinite_stop_reaches_the_engine(tmp_path):
    """--nonfinite stop without clipping: the engine runs with it (a non-finite gradient would stop the run), and
    the record says whether its plan streamed the gradients; the default skips."""
    records, _ = run_smoke(tmp_path / "stop.json", "slidedp", extra=["--max-grad-norm", "none", "--nonfinite", "stop"])
    r = records[0]
    assert r["error"] is None and r["nonfinite"] == "stop" and r["max_grad_norm"] is None
    assert isinstance(r["streamed_gradients"], bool)
    assert ("a non-finite gradient stops training" in r["plan_summary"]) == r["streamed_gradients"]


def test_systems_train_the_same_model_on_the_same_batches(smoke):
    same_training(smoke[1])


@pytest.mark.slow
def test_fsdp2_cpu_offload_on_cpu(smoke):
    tmp, records, _ = smoke
    bench = load_script()
    out = tmp / "with_fsdp2.json"
    out.write_text(json.dumps(records))
    merged, stdout = run_smoke(out, "fsdp2_cpu_offload", merge=True)  # --merge keeps the other records
    assert [r["system"] for r in merged] == ["slidedp", "gpu_resident", "fsdp2_cpu_offload"]
    fsdp = merged[-1]
    check_record(bench, fsdp)
    assert "CPUOffloadPolicy" in fsdp["offload_policy"] and "gloo" in fsdp["process_group"]
    assert "AdamW" in fsdp["optimizer"] and fsdp["activation_checkpointing"]
    same_training(merged)
    assert "| FSDP2 + CPU offload |" in stdout and "| slidedp |" in stdout


def test_readme_table_from_records(smoke, tmp_path):
    _, records, stdout = smoke
    bench = load_script()
    table = bench.render_table(records)
    assert "| slidedp |" in table and "| slidedp |" in stdout
    resident = next(r for r in records if r["system"] == "gpu_resident")
    row = next(line for line in table.splitlines() if "| GPU-resident" in line)
    # the baseline's row says how many of its blocks were checkpointed
    assert f"| GPU-resident ({resident['checkpointed_blocks']}/" in row and " blocks checkpointed) |" in row
    assert "| GPU-resident (" in stdout
    assert "1.00x" in table  # the baseline against itself
    section = bench.render_section(records, tmp_path / "records.json")
    assert table in section and records[0]["command"] in section

    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nbefore\n")
    bench.update_readme(readme, "placeholder-section")
    bench.update_readme(readme, section)  # replaces between the markers, keeps the rest
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n")
    assert text.count(bench.README_BEGIN) == 1 and text.count(bench.README_END) == 1
    assert "placeholder-section" not in text and table in text

    json_path = tmp_path / "records.json"
    json_path.write_text(json.dumps(records))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--render", str(json_path), "--readme",
                           "--readme-path", str(readme)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| slidedp |" in proc.stdout and readme.read_text().count(bench.README_BEGIN) == 1


def test_ratios_are_against_each_baselines_fastest_configuration():
    """A baseline run with one micro-batch of every row and with several of one: the ratios are against
    the faster, and each row names its micro-batching."""
    bench = load_script()
    records = [
        {"system": "slidedp", "tokens_per_step": 16384, "tokens_per_s": 8000.0, "baseline_micro_rows": 1},
        {"system": "fsdp2_cpu_offload", "tokens_per_step": 16384, "tokens_per_s": 300.0, "baseline_micro_rows": 1},
        {"system": "fsdp2_cpu_offload", "tokens_per_step": 16384, "tokens_per_s": 2000.0, "baseline_micro_rows": 4},
        {"system": "fsdp2_cpu_offload", "tokens_per_step": 16384, "tokens_per_s": None, "error": "timeout",
         "baseline_micro_rows": 2},
    ]
    table = bench.render_table(records)
    slidedp_row = next(line for line in table.splitlines() if "| slidedp |" in line)
    assert "| 4.00x |" in slidedp_row and "26.67x" not in table
    assert "FSDP2 + CPU offload (4-row micro-batches)" in table and "| FSDP2 + CPU offload | – |" in table


def test_ratios_only_within_a_shape():
    bench = load_script()
    records = [
        {"system": "slidedp", "shape": "4b", "tokens_per_step": 4096, "tokens_per_s": 3000.0},
        {"system": "gpu_resident", "shape": "4b", "tokens_per_step": 4096, "tokens_per_s": 6000.0},
        {"system": "slidedp", "shape": "8b", "tokens_per_step": 4096, "tokens_per_s": 1500.0},
    ]
    table = bench.render_table(records)
    rows = {tuple(line.split(" | ")[:3]): line for line in table.splitlines()[2:]}
    assert "| 0.50x |" in rows["| 4b", "4,096", "slidedp"] and "0.25x" not in table
    assert "x |" not in rows["| 8b", "4,096", "slidedp"]  # no 8b baseline: no ratio
    assert "shape" not in bench.render_table(records[:2])  # one shape: no shape column



def test_steady_figures_and_their_marks_in_the_table():
    from benchmarks.common.steady import steady_fields

    bench = load_script()
    times = [0.5] + [1.0] * 5 + [1.2] * 5 + [3.0]  # --steps 12: a short first, a last with the flush
    f = steady_fields(times, 4096)
    assert f["steady_steps"] == 10 and f["few_steps"] is False
    assert f["median_step_s"] == 1.1 and f["mean_step_s"] == pytest.approx(1.1) and f["tokens_per_s"] == 4096 / 1.1
    assert steady_fields([1.0, 2.0], 64)["steady_steps"] == 2  # under 3 timed steps: all of them, marked
    assert steady_fields([1.0, 2.0], 64)["few_steps"] is True
    import argparse

    from benchmarks.common.cli import add_model_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert parser.parse_args([]).steps == 12  # by default 10 steady steps: unmarked
    base = {"system": "slidedp", "shape": "4b", "tokens_per_step": 4096, "predicted_step_s": 1.0}
    steady = {**base, "measured_step_s": 1.25, **f}
    table = bench.render_table([steady])
    assert "| 3,724 |" in table and "| 1.100 / 1.000 |" in table and "*" not in table and "†" not in table
    few = {**base, "measured_step_s": 1.5, **steady_fields([1.0, 1.2, 2.3], 4096)}
    table = bench.render_table([few])
    assert "| 1.200* / 1.000 |" in table and "| 3,413* |" in table and "fewer than 10 steady steps" in table
    old = {**base, "measured_step_s": 1.5, "tokens_per_s": 4096 / 1.5, "step_times_s": [1.0, 1.2, 2.3]}
    table = bench.render_table([old])  # a record from before the steady fields: its mean, marked
    assert "| 1.500† / 1.000 |" in table and "| 2,731† |" in table and "before steady-state figures" in table


def test_failures_become_records(tmp_path):
    bench = load_script()
    assert bench.error_text(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "out of memory"
    assert bench.error_text(ValueError("bad")) == "ValueError: bad"
    records = [
        {"system": "slidedp", "tokens_per_step": 4096, "tokens_per_s": 2000.0, "measured_step_s": 2.048,
         "predicted_step_s": 1.9, "peak_device_bytes": 2**34, "peak_host_bytes": 2**36, "losses": [12.0]},
        {"system": "gpu_resident", "tokens_per_step": 4096, "tokens_per_s": None, "error": "out of memory"},
        {"system": "fsdp2_cpu_offload", "tokens_per_step": 4096, "tokens_per_s": 1000.0, "measured_step_s": 4.096},
    ]
    table = bench.render_table(records)
    assert "| out of memory |" in table and "2.00x" in table
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--tokens", "64",
                           "--systems", "gpu_resident", "--timeout-s", "0.5", "--out", str(out), "--allow-dirty"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["error"].startswith("timeout") and r["tokens_per_s"] is None
    assert all(k in r for k in bench.REQUIRED_KEYS)


def test_a_merge_keeps_another_commits_point_and_replaces_a_rerun():
    """Two trees measured into one file (--merge) keep both points; a rerun of the same point replaces it."""
    bench = load_script()
    old = {"system": "slidedp", "tokens_per_step": 16384, "git_commit": "5e69562", "budget_bytes": 24 * 2**30}
    new = {**old, "git_commit": "a07f4e6"}
    assert bench._point(old) != bench._point(new)
    assert bench._point(new) == bench._point(dict(new, tokens_per_s=1.0))
    assert bench._point(new) != bench._point(dict(new, budget_bytes=40 * 2**30))


def test_a_merge_keeps_every_other_configuration():
    """Points of the same system, tokens, budget and commit but another shape (or clipping, micro-batching,
    card, plan) are not reruns of each other: a --merge keeps both."""
    bench = load_script()
    point = {"system": "slidedp", "tokens_per_step": 4096, "git_commit": "048aa07", "budget_bytes": 40 * 2**30,
             "shape": "8b", "max_grad_norm": 1.0, "slidedp_micro_rows": 1, "device_name": "NVIDIA H100 80GB HBM3"}
    for change in ({"shape": "llama8b"}, {"max_grad_norm": None}, {"slidedp_micro_rows": 2},
                   {"device_name": "NVIDIA H200"}, {"nonfinite": "stop"}, {"checkpoint_setting": "all"},
                   {"plan_sha256": "f2dc8c62"}):
        assert bench._point(point) != bench._point({**point, **change}), change
    assert bench._point({k: v for k, v in point.items() if k != "shape"}) == bench._point({**point, "shape": "4b"})
