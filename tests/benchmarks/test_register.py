"""Predictions registered before their run (benchmarks/predict_vs_measured/register.py): a registered plan
runs as it was registered, and the measured record is tied to its registration by the plan's sha256."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.fit_set import registered_before, registrations
from benchmarks.predict_vs_measured.register import layer_ids, point_arg, register, register_twin
from tests.benchmarks.test_single_gpu_throughput import SCRIPT


def run_in_process(capsys, *argv: str):
    """single_gpu_throughput's run.py in this process (no point starts in no time): (exit status, stdout, stderr)."""
    import benchmarks.single_gpu_throughput.run as bench

    capsys.readouterr()
    status = bench.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_registered_plan_runs_as_registered_and_is_matched_to_its_record(tmp_path, capsys):
    """register.py's record run by single_gpu_throughput's --registered: the point's own plan and prediction,
    tied to the registration by sha256; with no time left, the point is not started."""
    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                      precision="fp32")  # the CPU smoke's precision
    plan_file = tmp_path / "registered" / f"{row['plan_sha256'][:16]}.json"
    assert plan_file.exists() and row["predicted_step_s"] > 0 and not row["fitted"]
    assert "--plan" in row["command"] and "--shape tiny --tokens 64 --budget 1GiB" in row["command"]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "2026-01-01-registered-x.json").write_text(json.dumps(
        {"registered_utc": "2026-01-01T00:00:00+00:00", "points": [row]}))

    registration = tmp_path / "results" / "2026-01-01-registered-x.json"
    out = tmp_path / "r.json"
    status, _, stderr = run_in_process(capsys, "--registered", str(registration), "--device", "cpu", "--out",
                                       str(out), "--allow-dirty", "--time-left-s", "1")
    assert status == 0 and "not started, about" in stderr and not out.exists()  # no time: not run
    proc = subprocess.run([sys.executable, str(SCRIPT), "--registered", str(registration), "--device", "cpu",
                           "--out", str(out), "--allow-dirty", "--timeout-s", "120", "--host-calibration"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (measured,) = json.loads(out.read_text())
    assert measured["shape"] == "tiny" and measured["error"] is None
    assert measured["plan_sha256"] == row["plan_sha256"]
    assert measured["predicted_step_s"] == row["predicted_step_s"]  # the registered prediction, not a new one
    # the host measured first (slidedp calibrate --host-only), the plan predicted again with it before the steps
    host = json.loads(Path(measured["host_profile"]).read_text())
    assert host["name"].endswith(", host re-measured")
    assert measured["host_fields"]["cpu_adamw_params_per_s"] == host["cpu_adamw_params_per_s"]
    assert measured["host_predicted_utc"] < measured["measure_start_utc"]
    assert measured["host_predicted_step_s"] > 0
    registered = registrations(tmp_path / "results")
    assert registered_before(measured, registered)
    assert not registered_before({**measured, "measure_start_utc": "2025-12-31T00:00:00+00:00"}, registered)
    assert not registered_before({**measured, "plan_sha256": "0" * 64}, registered)


def test_points_measured_already_are_not_run_again(tmp_path, capsys):
    """A registration's points with a clean record of their plan in single_gpu_throughput's results are
    skipped (the H100 registration's points have run) unless --remeasure; with no time left the others are
    not started."""
    registration = SCRIPT.parents[1] / "predict_vs_measured" / "results" / "2026-12-06-registered-h100-held-out.json"
    out = tmp_path / "r.json"
    args = ["--registered", str(registration), "--out", str(out), "--allow-dirty", "--time-left-s", "0"]
    status, stdout, stderr = run_in_process(capsys, *args)
    assert status == 0, stderr[-2000:]
    assert "1.7b, 8192 tokens/step: measured already" in stdout
    points = len(json.loads(registration.read_text())["points"])
    assert stdout.count("measured already") + stderr.count("not started") == points and not out.exists()
    # --remeasure: every point again (here none starts, in no time)
    status, stdout, stderr = run_in_process(capsys, *args, "--remeasure")
    assert status == 0, stderr[-2000:]
    assert "measured already" not in stdout and stderr.count("not started") == points and not out.exists()


def test_a_twin_is_registered_with_its_own_prediction_and_credited_to_the_edit(tmp_path):
    """register.py --twin-of: the twin's plan is kept beside the others under its sha256, its prediction is
    the cost model's for it (made here, before any run), and its command runs that plan; a plan solved under
    other hardware is refused. --keep takes comma-separated ids or 'none'."""
    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path, steps=3, precision="fp32")
    plan_file = tmp_path / f"{row['plan_sha256'][:16]}.json"
    twin = register_twin(("tiny", 64, "1GiB"), "cpu", str(plan_file), (), folder=tmp_path, steps=3)
    kept = json.loads((tmp_path / f"{twin['plan_sha256'][:16]}.json").read_text())
    assert kept["explanation"]["predicted"]["step_s"] == twin["predicted_step_s"] > 0
    assert "edited" in kept["explanation"]["solver"]["searches"]["streamed updates"]
    assert twin["plan_file"] in twin["command"] and twin["plan_sha256"] != row["plan_sha256"]
    with pytest.raises(ValueError, match="was solved under"):
        register_twin(("tiny", 64, "1GiB"), "h100-sxm", str(plan_file), (), folder=tmp_path)
    assert layer_ids("9") == (9,) and layer_ids("0,9") == (0, 9) and layer_ids("none") == ()
    with pytest.raises(argparse.ArgumentTypeError):
        layer_ids("prologue")


def test_points_are_named_shape_tokens_budget():
    """--points takes SHAPE:TOKENS:BUDGET; a shape the benchmarks do not know, or a bad count, is refused."""
    assert point_arg("1.7b:16384:8GiB") == ("1.7b", 16384, "8GiB")
    for bad in ("1.7b:16384", "nope:4096:8GiB", "4b:many:8GiB", "4b:0:8GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            point_arg(bad)


def test_registered_points_run_only_on_their_card(tmp_path, monkeypatch, capsys):
    """The H100 registration on another card is refused before anything runs: its measurement would not
    be the registered prediction's."""
    import torch

    import benchmarks.single_gpu_throughput.run as bench

    registration = SCRIPT.parents[1] / "predict_vs_measured" / "results" / "2026-12-06-registered-h100-held-out.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    started = []
    monkeypatch.setattr(bench, "drive", lambda args: started.append(args) or 0)
    out = tmp_path / "r.json"
    assert bench.main(["--registered", str(registration), "--device", "cuda", "--out", str(out)]) == 2
    assert "registered for NVIDIA H100 80GB HBM3, this is NVIDIA H200" in capsys.readouterr().err
    assert not started and not out.exists()
    # on its own card it goes on (here: nothing left to run in no time)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert bench.main(["--registered", str(registration), "--device", "cuda", "--out", str(out),
                       "--time-left-s", "0"]) == 0
    assert "registered for" not in capsys.readouterr().err


def test_points_registered_without_clipping_run_without_it(tmp_path):
    """A registration without clipping and with nonfinite stop: its plan solved so (stop: early updates, if
    any, in place), and the command that runs it says both, so the run compiles what was registered."""
    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                      precision="fp32", max_grad_norm=None, nonfinite="stop")
    assert row["max_grad_norm"] is None and row["nonfinite"] == "stop"
    assert "--max-grad-norm none --nonfinite stop --merge" in row["command"]
    plan = json.loads((tmp_path / "registered" / f"{row['plan_sha256'][:16]}.json").read_text())["schedule"]
    assert not plan["early_order"] or plan["streamed_gradients"] or plan["early_in_place"]
    (default,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                          precision="fp32")
    assert default["max_grad_norm"] == 1.0 and "--max-grad-norm" not in default["command"]


def test_a_shape_may_be_registered_under_its_own_profile(tmp_path):
    """--hardware-for SHAPE=PROFILE: that shape's points are solved under (and run with) its profile, the
    others under --hardware; a shape the benchmarks do not know is refused."""
    from benchmarks.common.cli import shape_hardware_arg
    from slidedp.costmodel.hardware import PRESETS, with_step_fits

    own = tmp_path / "tiny.json"
    profile = with_step_fits(PRESETS["cpu"], block_ratio=0.5, block="tiny")
    profile.save(own)
    rows = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                    precision="fp32", hardware_for={"tiny": str(own)})
    (row,) = rows
    assert row["hardware"] == profile.name and f"--hardware {own}" in row["command"]
    (plain,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                        precision="fp32", hardware_for={"4b": str(own)})
    assert plain["hardware"] == "cpu" and "--hardware cpu" in plain["command"]
    assert shape_hardware_arg(f"1.7b={own}") == ("1.7b", str(own))
    for bad in ("nope=x.json", "1.7b=", "1.7b"):
        with pytest.raises(argparse.ArgumentTypeError):
            shape_hardware_arg(bad)


def test_a_registered_point_that_cannot_finish_in_the_time_left_is_not_started(tmp_path, monkeypatch, capsys):
    """With --time-left-s, a point whose build and steps (at its predicted step) would not fit is passed
    over, not started and cut off, and a later, shorter point still runs, with the time then left."""
    import benchmarks.single_gpu_throughput.run as bench

    def point(shape, step_s):
        return {"shape": shape, "tokens_per_step": 4096, "budget": "8GiB", "hardware": "h100-sxm",
                "plan_sha256": shape * 8, "predicted_step_s": step_s,
                "command": f"python run.py --shape {shape} --tokens 4096 --out OUT.json"}

    registration = tmp_path / "2026-01-01-registered-x.json"
    registration.write_text(json.dumps({"points": [point("8b", 20.0), point("1.7b", 0.5)]}))
    started = []
    monkeypatch.setattr(bench, "main", lambda argv: started.append(argv) or 0)
    args = argparse.Namespace(registered=str(registration), device="cpu", out=str(tmp_path / "r.json"),
                              timeout_s=600.0, time_left_s=200.0, remeasure=False, allow_dirty=False,
                              host_calibration=False)
    assert bench.run_registered(args) == 0
    assert "8b, 4096 tokens/step: not started, about 385 s needed, 200 s left" in capsys.readouterr().err
    (argv,) = started
    assert argv[argv.index("--shape") + 1] == "1.7b" and 190 < float(argv[argv.index("--time-left-s") + 1]) <= 200
    assert bench.registered_point_s(point("x", 1.0), 12) == 60 + 13 * 1.25
    # the build grows with the host memory the plan writes (from its registered file)
    assert bench.registered_point_s(point("x", 1.0), 12, 100 * 2**30) == 60 + 50 + 13 * 1.25
    registered = json.loads((bench.REPO / "benchmarks/predict_vs_measured/results/"
                                          "2026-12-06-registered-h100-held-out-3.json").read_text())
    eight_b = next(p for p in registered["points"] if p["plan_sha256"].startswith("743c8d11"))
    assert 107 * 2**30 < bench.plan_host_bytes(eight_b) < 108 * 2**30  # its plan's 107.56 GiB
    assert bench.plan_host_bytes(point("x", 1.0)) == 0  # no plan file: no build term


def test_a_point_whose_blocks_compiled_earlier_in_the_run_is_charged_less_warm_up(tmp_path, monkeypatch, capsys):
    """A second point of the same shape and micro-batch rows finds its compiled blocks in Inductor's cache:
    its warm-up is charged 8 s, not 25, so it starts in time a first one of its kind would not have."""
    import benchmarks.single_gpu_throughput.run as bench

    def point(sha, shape="1.7b", rows=1):
        return {"shape": shape, "tokens_per_step": 4096, "budget": "8GiB", "hardware": "h100-sxm",
                "plan_sha256": sha * 16, "predicted_step_s": 1.0, "slidedp_micro_rows": rows,
                "command": f"python run.py --shape {shape} --tokens 4096 --out OUT.json"}

    assert bench.registered_point_s(point("a"), 12, compiled_before=True) == 43 + 13 * 1.25
    assert bench.compile_key(point("a")) == bench.compile_key(point("b")) != bench.compile_key(point("c", rows=2))
    clock = [0.0]
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock[0])
    started = []

    def run_point(argv):  # each point takes 80 s of the 150
        started.append(argv)
        clock[0] += 80.0
        return 0

    monkeypatch.setattr(bench, "main", run_point)
    for later, runs in ((point("b"), 2), (point("c", rows=2), 1)):
        registration = tmp_path / "2026-01-01-registered-x.json"
        registration.write_text(json.dumps({"points": [point("a"), later]}))
        started.clear()
        clock[0] = 0.0
        args = argparse.Namespace(registered=str(registration), device="cpu", out=str(tmp_path / "r.json"),
                                  timeout_s=600.0, time_left_s=150.0, remeasure=False, allow_dirty=False,
                                  host_calibration=False)
        assert bench.run_registered(args) == 0
        assert len(started) == runs  # 70 s left: 59 s needed by a second 1-row point, 76 s by a 2-row one
    assert "not started, about 76 s needed, 70 s left" in capsys.readouterr().err


def test_a_profile_with_the_adamw_share_measured_beside_copies(tmp_path):
    """register.py --adamw-beside-copies: the profile saved beside the registrations holds the share an
    in_step.py record measured in calibrate's setting, and its name says so (the card and the fit it came
    from still read from it)."""
    from benchmarks.common.fit_set import card_of, used_in_fitting
    from benchmarks.predict_vs_measured.register import derived_profile
    from slidedp.costmodel.hardware import Hardware

    source = Path(__file__).resolve().parents[2] / "benchmarks/predict_vs_measured/results"
    record = tmp_path / "2026-01-01-in-step.json"
    record.write_text(json.dumps({"cores": 8, "rows": [
        {"condition": "NumPy arrays, 8 threads (as calibrate)", "params_per_s": 4e9},
        {"condition": "NumPy arrays, 8 threads, copies both ways (as calibrate)", "params_per_s": 2.6e9}]}))
    path = derived_profile(str(source / "2026-12-06-h100-profile-qwen3-8b.json"), str(record), tmp_path / "profiles")
    hw = Hardware.load(path)
    original = Hardware.load(source / "2026-12-06-h100-profile-qwen3-8b.json")
    assert hw.cpu_adamw_contended_fraction == pytest.approx(0.65)
    assert hw.name == original.name + ", AdamW beside copies 0.650 (2026-01-01-in-step.json)"
    assert hw.cpu_adamw_params_per_s == original.cpu_adamw_params_per_s  # the rest is the profile's own
    assert card_of(hw.name) == "NVIDIA H100 80GB HBM3"
    assert not used_in_fitting({"shape": "8b"}, hw.name) and used_in_fitting({"shape": "4b"}, hw.name)


def test_points_measured_in_the_out_file_are_not_run_again(tmp_path, capsys):
    """A point whose record is in --out already (an earlier call on the same machine, its records not yet in
    the repository) is skipped like one in the study's results."""
    registration = SCRIPT.parents[1] / "predict_vs_measured" / "results" / "2026-12-06-registered-h200-held-out.json"
    points = json.loads(registration.read_text())["points"]
    later = next(p for p in points if p["shape"] == "llama3b" and p["tokens_per_step"] == 4096)
    out = tmp_path / "r.json"
    out.write_text(json.dumps([{"plan_sha256": later["plan_sha256"], "error": None, "median_step_s": 0.9},
                               {"plan_sha256": points[-1]["plan_sha256"], "error": "timeout", "median_step_s": None}]))
    status, stdout, stderr = run_in_process(capsys, "--registered", str(registration), "--out", str(out),
                                            "--allow-dirty", "--time-left-s", "0")
    assert status == 0, stderr[-2000:]
    assert "llama3b, 4096 tokens/step: measured already" in stdout
    last = f"{points[-1]['shape']}, {points[-1]['tokens_per_step']} tokens/step"
    assert f"{last}: not started" in stderr  # a failed record does not count as measured


def test_points_run_before_on_the_card_are_refused(tmp_path):
    """A point slidedp already ran on the card (same shape, tokens, budget and rows, any plan) is not held out:
    measured_before names it, for that card only, and register.py refuses it without --again."""
    from benchmarks.predict_vs_measured.register import main, measured_before

    record = {"system": "slidedp", "shape": "1.7b", "tokens_per_step": 8192, "budget_bytes": 8 * 2**30,
              "device_name": "NVIDIA H200"}
    (tmp_path / "a.json").write_text(json.dumps([record, {"system": "fsdp2", "shape": "1.7b"}]))
    points = [("1.7b", 8192, "8GiB"), ("1.7b", 8192, "12GiB"), ("1.7b", 16384, "8GiB"), ("8b", 8192, "8GiB")]
    assert measured_before(points, "h200-sxm", results=tmp_path) == [("1.7b", 8192, "8GiB")]
    assert measured_before(points, "h100-sxm", results=tmp_path) == []  # another card
    assert measured_before(points, "h100-sxm", {"1.7b": "h200-sxm"}, results=tmp_path) == [("1.7b", 8192, "8GiB")]
    assert measured_before(points, "h200-sxm", micro_rows=2, results=tmp_path) == []  # another micro-batching
    # the repository's own records: Qwen3-1.7B at 8,192 tokens within 8 GiB ran on an H200
    with pytest.raises(SystemExit):
        main(["--hardware", "h200-sxm", "--points", "1.7b:8192:8GiB", "--out", str(tmp_path / "r.json"),
              "--allow-dirty"])
    assert not (tmp_path / "r.json").exists()


def test_a_registered_plan_that_no_longer_fits_is_not_built(tmp_path):
    """A registered plan whose program today's compile would refuse (here: its point's budget taken below what
    the program needs, as a change to what a program is charged does) is named before any build; as
    registered, it is not."""
    from benchmarks.single_gpu_throughput import run

    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3, precision="fp32")
    assert Path(row["plan_file"]).is_absolute()  # outside the repository: kept as an absolute path
    assert run.plan_refusal(row) is None
    refused = run.plan_refusal(dict(row, budget="64KiB"))
    assert refused is not None and "over the budget" in refused


def test_a_point_registered_with_auto_rows_holds_its_plans_grouping(tmp_path):
    """--micro-rows auto: the plan groups the rows (group_rows), and the row and its command carry the grouping
    the plan chose; the argument takes a positive number or 'auto' only."""
    from benchmarks.predict_vs_measured.register import micro_rows_arg

    (row,) = register([("tiny", 4 * 32, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                      precision="fp32", micro_rows=None)
    plan = json.loads((tmp_path / "registered" / f"{row['plan_sha256'][:16]}.json").read_text())
    rows = plan["workload"]["batch_size"]
    assert row["slidedp_micro_rows"] == rows and rows * plan["workload"]["micro_batches"] == 4
    assert set(plan["explanation"]["solver"]["rows_tried"]) == {"1", "2", "4"}
    assert ("--slidedp-micro-rows" in row["command"]) == (rows > 1)
    assert micro_rows_arg("auto") is None and micro_rows_arg("2") == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            micro_rows_arg(bad)


def test_a_point_with_no_plan_is_left_out_and_the_others_registered(tmp_path, capsys):
    """A point whose budget no plan fits is said on stderr with the solver's reason and left out, the others
    registered; when none fits, the first one's error is raised."""
    import slidedp

    rows = register([("tiny", 64, "64KiB"), ("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered",
                    steps=3, precision="fp32")
    assert [r["budget"] for r in rows] == ["1GiB"]
    err = capsys.readouterr().err
    assert "tiny:64:64KiB: not registered, no plan fits" in err and "1GiB" not in err
    with pytest.raises(slidedp.InfeasibleBudgetError):
        register([("tiny", 64, "64KiB")], "cpu", None, folder=tmp_path / "registered", steps=3, precision="fp32")


def test_sampled_points_are_drawn_by_the_seed_and_leave_out_what_ran_or_was_registered(tmp_path):
    """register.py --sample: the same seed draws the same points; none already run on the card (a record of
    the same shape, tokens and budget there) or in an earlier registration."""
    from benchmarks.predict_vs_measured.register import SAMPLE_BUDGETS, SAMPLE_TOKENS, sample_points

    results, registrations = tmp_path / "results", tmp_path / "registrations"
    results.mkdir()
    registrations.mkdir()
    grid = [("1.7b", t, b) for t in SAMPLE_TOKENS for b in SAMPLE_BUDGETS]
    ran, registered = grid[:50], grid[50:100]
    (results / "x.json").write_text(json.dumps([
        {"system": "slidedp", "shape": s, "tokens_per_step": t, "budget_bytes": int(b[:-3]) * 2**30,
         "device_name": "NVIDIA H100 80GB HBM3"} for s, t, b in ran]))
    (registrations / "2026-01-01-registered-x.json").write_text(json.dumps(
        {"points": [{"shape": s, "tokens_per_step": str(t), "budget": b} for s, t, b in registered]}))
    draw = lambda seed, k: sample_points(k, seed, ["1.7b"], "h100-sxm", results=results,  # noqa: E731
                                         registrations=registrations)
    left = len(grid) - 100
    everything = draw(1, left)
    assert sorted(everything) == sorted(grid[100:])  # all that is left, and only that
    assert draw(7, 10) == draw(7, 10) and draw(7, 10) != draw(8, 10)
    with pytest.raises(ValueError):
        draw(1, left + 1)  # no more points than the grid leaves
