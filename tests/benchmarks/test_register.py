"""Predictions registered before their run (benchmarks/predict_vs_measured/register.py): a registered plan
runs as it was registered, and the measured record is tied to its registration by the plan's sha256."""

from __future__ import annotations

import json

from benchmarks.common.fit_set import registered_before, registrations
from benchmarks.predict_vs_measured.register import register
from tests.benchmarks.test_single_gpu_throughput import run_smoke


def test_a_registered_plan_runs_as_registered_and_is_matched_to_its_record(tmp_path):
    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path / "registered", steps=3,
                      precision="fp32")  # the CPU smoke's precision
    plan_file = tmp_path / "registered" / f"{row['plan_sha256'][:16]}.json"
    assert plan_file.exists() and row["predicted_step_s"] > 0 and not row["fitted"]
    assert "--plan" in row["command"] and "--shape tiny --tokens 64 --budget 1GiB" in row["command"]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "2026-01-01-registered-x.json").write_text(json.dumps(
        {"registered_utc": "2026-01-01T00:00:00+00:00", "points": [row]}))

    records, _ = run_smoke(tmp_path / "r.json", "slidedp", extra=["--plan", str(plan_file), "--hardware", "cpu"])
    (measured,) = records
    assert measured["plan_sha256"] == row["plan_sha256"]
    assert measured["predicted_step_s"] == row["predicted_step_s"]  # the registered prediction, not a new one
    registered = registrations(tmp_path / "results")
    assert registered_before(measured, registered)
    assert not registered_before({**measured, "measure_start_utc": "2025-12-31T00:00:00+00:00"}, registered)
    assert not registered_before({**measured, "plan_sha256": "0" * 64}, registered)
