"""benchmarks/multi_gpu_scaling on the CPU: a tiny Qwen3, ranks as CPU processes on gloo, each
point in its own child process, records collected into JSON and rendered as the README section.

The default run measures every system with 2 ranks on the same global batches (about 60 s, mostly
processes importing torch: slidedp's two workers, FSDP2's two ranks); the one-rank points, which
complete the scaling table, are marked slow."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.multi_gpu_scaling.run as scaling
from benchmarks.common import systems, tables

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "multi_gpu_scaling" / "run.py"
# strong scaling at 128 tokens per step: 4 rows of 32 tokens, the same global batches for 1 and 2 ranks
TINY = ["--shape", "tiny", "--device", "cpu", "--mode", "strong", "--strong-tokens", "128", "--steps", "1",
        "--allow-dirty"]
SYSTEMS = ["slidedp", "fsdp2_cpu_offload", "fsdp2_gpu"]
ROUTE = "sharded/gpu"  # forced in slidedp's plan (the cpu-gloo hardware allows every route)
# Step-1 losses: fp32 everywhere, bit-identical initial weights and batches; the systems differ only in
# the order of floating-point sums (chunked vs whole cross-entropy, per-rank partial sums reduced by
# slidedp or by gloo). Each sum of n fp32 terms is within about n * 6e-8 relative: for 128 tokens and a
# 512-word vocabulary well under 1e-5 (observed: about 1e-7). Gradient norms (sums over every
# parameter, reduced in different orders) the same order: 1e-5. Step 2 follows AdamW steps of lr 1e-5,
# insensitive to those differences.
LOSS_RTOL = 1e-5


def load_script():
    return scaling


def run_script(out: Path, *extra: str, timeout_s: float = 400):
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--timeout-s", "200", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The intended workflow: slidedp's plans solved first (--solve-plans), then every system measured
    with those plans (--reuse-plans)."""
    tmp = tmp_path_factory.mktemp("scaling")
    plans = ["--world-sizes", "2", "--routes", ROUTE, "--plans-dir", str(tmp / "plans")]
    assert scaling.main([*TINY, "--solve-plans", *plans]) == 0  # in this process: no GPU, no weights
    records, stdout = run_script(tmp / "records.json", "--systems", *SYSTEMS, "--reuse-plans", *plans)
    return tmp, records, stdout


def check_record(bench, r: dict, world_size: int) -> None:
    assert r["error"] is None, (r["system"], r["error"], r.get("traceback"))
    missing = [k for k in bench.REQUIRED_KEYS if k not in r]
    assert not missing, (r["system"], missing)
    assert r["world_size"] == world_size and r["tokens_per_step"] == 128 and r["tokens_per_rank"] == 128 // world_size
    assert r["micro_batches_per_rank"] == 4 // world_size and r["modes"] == ["strong"]
    # one timed step: it is the steady figure too, marked as too few
    assert r["measured_step_s"] > 0 and r["median_step_s"] == r["mean_step_s"] == pytest.approx(r["measured_step_s"])
    assert r["tokens_per_s"] == pytest.approx(128 / r["median_step_s"])
    assert r["steady_steps"] == 1 and r["few_steps"] is True
    assert len(r["losses"]) == 2 and len(r["grad_norms"]) == 2
    # host memory: the summed PSS of the point's processes, every rank counted
    assert r["peak_host_bytes"] > 0 and len(r["host_pss_bytes_per_process"]) >= world_size
    assert r["peak_device_bytes"] is None  # no device memory on the CPU
    assert "multi_gpu_scaling/run.py" in r["command"] and len(r["date"]) == 10 and r["git_commit"]
    assert isinstance(r["dirty"], bool)
    assert r["env"]["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast off in every process of the run
    assert r["hardware"].startswith(f"{world_size} x ")


def test_every_system_writes_a_complete_record_with_two_ranks(two_ranks):
    tmp, records, stdout = two_ranks
    bench = load_script()
    assert [r["system"] for r in records] == SYSTEMS
    for r in records:
        check_record(bench, r, 2)
        assert r["params"] == bench.qwen3_params("tiny")
    slide, offload, resident = records
    assert slide["predicted_step_s"] > 0 and slide["budget_bytes"] == 40 * 2**30
    assert slide["hardware_profile"] == "cpu-gloo" and Path(slide["plan_path"]).parent == tmp / "plans"
    assert len(slide["host_pss_bytes_per_process"]) >= 3  # the driving process and two workers
    assert slide["peak_device_bytes_per_rank"] == [None, None]  # each worker asked (no device memory on the CPU)
    for r, policy in ((offload, "CPUOffloadPolicy"), (resident, "none")):
        assert r["route"] is None and r["predicted_step_s"] is None
        assert r["process_group"] == "gloo, world size 2" and r["offload_policy"].startswith(policy)
        assert "AdamW" in r["optimizer"] and r["activation_checkpointing"]
    for name in ("| slidedp | sharded/gpu | 2 |", "| FSDP2 + CPU offload | – | 2 |", "| FSDP2 on the GPUs | – | 2 |"):
        assert name in stdout


def load_plan(path) -> dict:
    """A saved plan as JSON (slidedp.Plan.load would import torch into this process: seconds)."""
    return json.loads(Path(path).read_text())


def test_the_forced_route_is_in_the_plan(two_ranks):
    tmp, records, _ = two_ranks
    slide = records[0]
    (solved,) = (tmp / "plans").glob("*.json")  # --solve-plans: one plan, the one the point reused
    assert solved.name == "qwen3_tiny_40GiB_w2_128_sharded-gpu.json"
    assert slide["plan_reused"] == slide["plan_path"] == str(solved) and "plan_solve_s" not in slide
    assert slide["route"] == ROUTE and slide["route_planned"] == ROUTE
    assert slide["solver_options"] == {"deliveries": ["sharded"], "reductions": ["gpu"]}
    assert slide["plan_routes"] == {"prologue": [ROUTE], "block": [ROUTE], "epilogue": [ROUTE]}
    plan = load_plan(solved)
    assert plan["workload"]["world_size"] == 2 and plan["workload"]["micro_batches"] == 2
    assert not plan["workload"]["compiled_blocks"] and plan["hardware"]["name"] == "cpu-gloo"
    assert {f"{d['delivery']}/{d['reduction']}" for d in plan["schedule"]["decisions"]} == {ROUTE}
    assert any("routes forced" in note for note in plan["explanation"]["notes"])


def same_training(records: list[dict]) -> None:
    """Same initial weights, the same global batch, the same AdamW: the same losses and gradient norms."""
    for i in (0, 1):
        losses = [r["losses"][i] for r in records]
        assert max(losses) - min(losses) <= LOSS_RTOL * losses[0], (i, losses)
        norms = [r["grad_norms"][i] for r in records]
        assert max(norms) - min(norms) <= LOSS_RTOL * norms[0], (i, norms)
    # random init: the mean next-token loss is about ln(vocab), so it is a mean over the global batch
    assert records[0]["losses"][0] == pytest.approx(math.log(512), abs=0.05)


def test_slidedp_and_fsdp2_agree_on_the_same_batches(two_ranks):
    same_training(two_ranks[1])


@pytest.mark.slow
def test_one_rank_points_complete_the_scaling_table(two_ranks):
    tmp, records, _ = two_ranks
    bench = load_script()
    out = tmp / "with_one_rank.json"
    out.write_text(json.dumps(records))
    merged, stdout = run_script(out, "--world-sizes", "1", "--systems", *SYSTEMS, "--merge",
                                "--plans-dir", str(tmp / "plans"))
    assert len(merged) == 6
    one = [r for r in merged if r["world_size"] == 1]
    assert [r["system"] for r in one] == SYSTEMS and one[0]["route"] == "auto"
    for r in one:
        check_record(bench, r, 1)
    assert one[0]["route_planned"] == "replicated/cpu"
    same_training(merged)  # one rank or two, the same global batches: the same training
    idx = bench.Index(merged)
    for r in merged:
        assert idx.strong(r) > 0 and idx.host_growth(r) > 0 and idx.vs_offload(r) > 0
    assert "| slidedp | auto (replicated/cpu) | 1 |" in stdout and "100%" in stdout


def test_failing_points_become_records(tmp_path):
    bench = load_script()
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--world-sizes", "2", "--systems", "fsdp2_gpu",
                           "--timeout-s", "0.5", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["error"].startswith("timeout") and r["tokens_per_s"] is None and r["world_size"] == 2
    assert all(k in r for k in bench.REQUIRED_KEYS)

    # not enough GPUs, tokens that do not split into whole rows per rank: records, not crashes
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--device", "cuda", "--world-sizes", "3", "64",
                           "--strong-tokens", "2048", "--systems", "slidedp", "--routes", ROUTE, "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    three, many = json.loads(out.read_text())
    assert "do not split" in three["error"] and many["error"].startswith("needs 64 GPUs")
    assert all(k in r for r in (three, many) for k in bench.REQUIRED_KEYS)
    assert "needs 64 GPUs" in proc.stdout  # in the table

    args = argparse.Namespace(seq=None, shape="4b", device="cuda", host_ram_bytes=64 << 30)
    spec = bench.Spec("slidedp", ROUTE, 2, 65536)
    assert bench.preflight(spec, args, gpus=2).startswith("not enough host RAM")  # 16 B x 4.4 G params
    assert bench.preflight(spec, argparse.Namespace(**{**vars(args), "host_ram_bytes": 512 << 30}), gpus=2) is None
    assert systems.error_text(bench.DoesNotFit("does not fit: 70 GiB")) == "does not fit: 70 GiB"


def test_points_and_parameter_counts():
    bench = load_script()
    # the models' own counts (tiny: the records' "params", test above)
    assert bench.qwen3_params("4b") == 4_411_424_256 and bench.qwen3_params("8b") == 8_190_735_360
    args = argparse.Namespace(world_sizes=[1, 2, 4], mode="both", strong_tokens=65536, weak_tokens_per_rank=16384,
                              systems=["slidedp", "fsdp2_cpu_offload"], routes=["auto", ROUTE])
    specs = bench.points(args)
    # one GPU: one slidedp route; 4 GPUs: strong and weak are the same point
    assert [(s.world_size, s.tokens_per_step) for s in specs if s.system == "fsdp2_cpu_offload"] == [
        (1, 16384), (1, 65536), (2, 32768), (2, 65536), (4, 65536)]
    assert {s.route for s in specs if s.system == "slidedp" and s.world_size == 1} == {"auto"}
    assert len([s for s in specs if s.system == "slidedp"]) == 2 + 2 * 2 + 2
    assert bench.modes_of(args, 4, 65536) == ["strong", "weak"]


def synthetic_records() -> list[dict]:
    def rec(system, route, w, tokens, tps, host=None, predicted=None, error=None, modes=("strong",)):
        return {"shape": "4b", "system": system, "route": route, "world_size": w, "tokens_per_step": tokens,
                "tokens_per_rank": tokens // w, "tokens_per_s": tps, "measured_step_s": tokens / tps if tps else None,
                "predicted_step_s": predicted, "peak_host_bytes": host, "losses": [12.0] if tps else None,
                "error": error, "modes": list(modes), "date": "2026-01-01", "command": "python multi_gpu_scaling.py",
                "median_step_s": tokens / tps if tps else None, "steady_steps": 10, "few_steps": False}

    return [
        rec("slidedp", "auto", 1, 65536, 15000.0, host=70 << 30, predicted=4.2),
        rec("slidedp", "sharded/gpu", 2, 65536, 28500.0, host=72 << 30, predicted=2.3),
        rec("slidedp", "sharded/gpu", 4, 65536, 51000.0, host=90 << 30, predicted=1.0, modes=("strong", "weak")),
        rec("fsdp2_cpu_offload", None, 1, 65536, 7000.0),
        rec("fsdp2_cpu_offload", None, 4, 65536, 20000.0),
        rec("fsdp2_gpu", None, 1, 65536, None, error="does not fit: 66.0 GiB per GPU > 40.0 GiB"),
    ]


def test_readme_table_renders(two_ranks, tmp_path):
    bench = load_script()
    records = synthetic_records()
    table = bench.render_table(records)
    assert "| 4b | slidedp | sharded/gpu | 4 | 65,536 | 16,384 | 51,000 | 85% |" in table  # 51000 / (4 x 15000)
    assert "| 95% |" in table and "2.55x" in table  # 2 GPUs; 51000 / 20000 FSDP2 offload on 4
    assert "| does not fit: 66.0 GiB per GPU > 40.0 GiB |" in table
    assert "| 1.29 |" in table  # host 90 / 70 GiB
    targets = bench.render_targets(records)
    assert "4b sharded/gpu at 65,536 tokens/step 85% missed" in targets and "lowest 2.14x" in targets and "at most 1.29x missed" in targets
    assert "4b auto worst" in targets and "met" in targets
    assert "*" not in table and "†" not in table  # 10 steady steps each: unmarked
    few = [{**records[2], "steady_steps": 3, "few_steps": True}, {k: v for k, v in records[3].items()
                                                                  if k not in ("median_step_s", "steady_steps")}]
    marked = bench.render_table(few)
    assert "| 51,000* |" in marked and "| 7,000† |" in marked
    assert "fewer than 10 steady steps" in marked and "before steady-state figures" in marked

    section = bench.render_section(two_ranks[1] + records, tmp_path / "records.json")
    assert bench.render_table(two_ranks[1] + records) in section and two_ranks[1][0]["command"] in section
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nbefore\n\n<!-- single_gpu_throughput:begin -->\nother\n<!-- single_gpu_throughput:end -->\n")
    tables.update_readme(readme, "placeholder-section", bench.README_BEGIN, bench.README_END)
    assert readme.read_text().endswith(f"{bench.README_BEGIN}\nplaceholder-section\n{bench.README_END}\n")  # appended at the end
    tables.update_readme(readme, section, bench.README_BEGIN, bench.README_END)  # replaced, the rest kept
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n<!-- single_gpu_throughput:begin -->\nother\n<!-- single_gpu_throughput:end -->")
    assert text.count(bench.README_BEGIN) == 1 and "placeholder-section" not in text and section in text

    json_path = tmp_path / "records.json"
    json_path.write_text(json.dumps(records))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--render", str(json_path), "--readme",
                           "--readme-path", str(readme)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| slidedp | sharded/gpu |" in proc.stdout and readme.read_text().count(bench.README_END) == 1
