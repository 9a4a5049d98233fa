"""benchmarks/cpu_adamw: numba against torch like for like, every case recorded, nothing recorded when the
implementations' results differ."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import benchmarks.common.records as records
import benchmarks.cpu_adamw.run as study
from benchmarks import make_readme

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_study_runs_as_a_script_and_records_every_case(tmp_path):
    out = tmp_path / "2026-01-01-test.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_adamw" / "run.py"), "--quick", "--allow-dirty",
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert len(rec["git_commit"]) == 40 and rec["host"]["host_cores"] == os.cpu_count()
    assert rec["impls"] == ["numba", "torch_fused", "torch_foreach"] and rec["threads"] == [1]
    keys = {(c["numel"], c["grad_dtype"], c["bf16_copy"], c["threads"], c["impl"]) for c in rec["cases"]}
    assert keys == {(40_009, d, copy, 1, impl) for d in ("fp32", "bf16") for copy in (False, True)
                    for impl in rec["impls"]}
    for c in rec["cases"]:
        assert c["median_s"] > 0 and c["iqr_s"] >= 0 and c["calls"] >= 1
        per_elem = 24 + (2 if c["grad_dtype"] == "bf16" else 4) + (2 if c["bf16_copy"] else 0)
        assert c["state_bytes"] == 40_009 * per_elem
        assert c["state_gb_per_s"] == pytest.approx(c["state_bytes"] / c["median_s"] / 1e9)
    assert len(rec["checks"]) == 4 * 3 and all(c["ok"] for c in rec["checks"])
    assert all(c["bf16_copy_is_rounded_param"] for c in rec["checks"] if c["bf16_copy"])
    assert all(c["param_max_ulps"] <= study.FP32_ULPS_MAX for c in rec["checks"])
    assert len(rec["comparisons"]) == 4
    for r in rec["comparisons"]:
        assert r["torch_fused_over_numba"] == pytest.approx(r["torch_fused_s"] / r["numba_s"])
    # the README table is made from such a record
    table = study.render_table(rec)
    assert table.count("\n| 40,009 |") == 4 and "torch faster by more than 3%" in table


def _quick(tmp_path, *extra):
    return ["--quick", "--threads", "1", "--numel", "20000", "--out", str(tmp_path / "r.json"), *extra]


@pytest.mark.parametrize("wrong", ["update", "copy"])
def test_results_that_differ_are_refused_before_timing(tmp_path, monkeypatch, wrong):
    real = study.IMPLS["torch_fused"]

    def wrong_update(arrays, out, step, threads):  # a weight decay twice too strong: 1e-5 of |p|, ~100 ulps
        real(arrays, out, step, threads)
        p = arrays[0]
        p -= np.float32(study.HYPER["lr"] * study.HYPER["weight_decay"]) * p
        if out is not None:
            out[:] = study.torch.from_numpy(p).to(study.torch.bfloat16).view(study.torch.uint16).numpy()

    def truncated_copy(arrays, out, step, threads):  # bf16 copy by truncation: within 1 ulp, not rounded
        real(arrays, out, step, threads)
        if out is not None:
            out[:] = (arrays[0].view(np.uint32) >> 16).astype(np.uint16)

    timed = []
    monkeypatch.setitem(study.IMPLS, "torch_fused", wrong_update if wrong == "update" else truncated_copy)
    monkeypatch.setattr(study, "time_case", lambda *a, **k: timed.append(a))
    with pytest.raises(study.ResultsDiffer, match="nothing recorded"):
        study.main(_quick(tmp_path, "--allow-dirty", "--impls", "numba", "torch_fused"))
    assert not timed and not (tmp_path / "r.json").exists()


def test_without_git_the_commit_comes_from_bench_git_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "REPO", tmp_path)  # no checkout there
    monkeypatch.setenv("BENCH_GIT_COMMIT", "b" * 40)
    threads = study.torch.get_num_threads(), study.numba.get_num_threads()
    assert study.main(_quick(tmp_path, "--impls", "numba", "torch_fused", "--grad-dtypes", "bf16")) == 0
    # timed at 1 thread, in this process: the caller's thread counts are as they were
    assert (study.torch.get_num_threads(), study.numba.get_num_threads()) == threads
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["git_commit"] == "b" * 40 and rec["commit_from"] == "BENCH_GIT_COMMIT" and rec["dirty"] is False
    assert {c["impl"] for c in rec["cases"]} == {"numba", "torch_fused"}


def test_torch_faster_needs_every_size_and_the_margin():
    def case(numel, impl, s):
        return dict(numel=numel, grad_dtype="bf16", bf16_copy=True, threads=16, impl=impl, median_s=s)

    cases = [case(1, "numba", 1.0), case(1, "torch_fused", 0.9), case(2, "numba", 1.0), case(2, "torch_fused", 0.9)]
    rows, faster = study.compare(cases, margin=0.03)
    assert faster == [["5+", True, "bf16"]] and not any(r["numba_at_least_as_fast"] for r in rows)
    cases[3] = case(2, "torch_fused", 0.98)  # faster, but within the margin at one size
    assert study.compare(cases, margin=0.03)[1] == []


def test_make_readme_renders_a_like_for_like_record(tmp_path, monkeypatch):
    rec = dict(host=dict(host_cpu="cpu", host_cores=16), simd=["avx2"], torch_version="t", numba_version="n",
               threading_layer="omp", margin=0.03, torch_faster=[["5+", True, "bf16"]],
               cases=[dict(numel=8, grad_dtype="bf16", bf16_copy=True, threads=16, impl="numba", state_gb_per_s=50.0)],
               comparisons=[dict(numel=8, grad_dtype="bf16", bf16_copy=True, threads=16, numba_s=1e-3,
                                 torch_fused_s=9e-4, torch_foreach_s=None, torch_fused_over_numba=0.9,
                                 numba_at_least_as_fast=False, torch_fused_faster=True)])
    monkeypatch.setattr(make_readme, "load", lambda study_name, name=None: rec)
    table = make_readme.table_cpu_adamw()
    assert "| 8 | bf16 | yes | 16 | 1 | 0.9 | – | 50.0 | 0.90x | torch fused |" in table
    assert "('5+', True, 'bf16')" in table


def test_the_in_step_rows_run_on_the_cpu_and_give_calibrates_fraction(tmp_path):
    """in_step.py: on the CPU the three rows without a device (the record's rates positive, one thread fewer
    in the second and third); `calibrate_fraction` reads calibrate's own row where the record has one,
    else the ratio of the rows in calibrate's setting."""
    from benchmarks.common.profiles import calibrate_fraction

    out = tmp_path / "2026-01-01-in-step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_adamw" / "in_step.py"), "--params", "1M",
                           "--repeats", "2", "--allow-dirty", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    cores = os.cpu_count()
    assert rec["params"] == 2**20 and rec["device"] == "cpu" and len(rec["rows"]) == 3
    assert [r["threads"] for r in rec["rows"]] == [cores, cores - 1, cores - 1]
    assert all(r["params_per_s"] > 0 for r in rec["rows"])
    rows = [{"condition": "NumPy arrays, 16 threads (as calibrate)", "params_per_s": 4.0},
            {"condition": "NumPy arrays, 16 threads, copies both ways (as calibrate)", "params_per_s": 2.8}]
    assert calibrate_fraction({"cores": 16, "rows": rows}) == pytest.approx(0.7)
    own = {"condition": "calibrate's measurement", "field": "cpu_adamw_contended_fraction", "fraction": 0.66,
           "params_per_s": 2.6}
    assert calibrate_fraction({"cores": 16, "rows": rows + [own]}) == 0.66


def test_the_engine_round_study_times_a_round_over_every_parameter(tmp_path):
    """engine_round.py: each step's round of host updates beside a flat AdamW call over as many parameters as
    the model has (its tied vocabulary counted once), both timed for every step."""
    import benchmarks.cpu_adamw.engine_round as engine_round

    out = tmp_path / "2026-01-01-round.json"
    assert engine_round.main(["--hidden", "256", "--layers", "1", "--vocab", "512", "--steps", "2",
                              "--allow-dirty", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    model = engine_round.qwen3_like(256, 1, 512)
    assert rec["params"] == sum(p.numel() for p in model.parameters())
    assert len(rec["round_s"]) == len(rec["flat_call_s"]) == 2 and min(rec["round_s"] + rec["flat_call_s"]) > 0
    assert rec["round_over_call"] == pytest.approx(rec["round_s"][1] / rec["flat_call_s"][1])
