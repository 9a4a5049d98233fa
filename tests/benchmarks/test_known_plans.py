"""benchmarks/known_plans: plans solved for named configurations, saved and recorded with their predictions."""

import json

import benchmarks.known_plans.run as mod


def test_plans_are_saved_and_recorded_with_predictions_and_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(mod, "HERE", tmp_path)
    fits = mod.Config("tiny-1", "llama-tiny", "h200-sxm", 1, 8, 16, 64, 2)
    two = mod.Config("tiny-2", "llama-tiny", "h200-sxm", 2, 8, 16, 64, 1)
    too_small = mod.Config("tiny-too-small", "llama-tiny", "h200-sxm", 1, 0.001, 16, 64, 2)
    floor = mod.Config("tiny-floor", "llama-tiny", "h200-sxm", 1, 0, 16, 64, 2, clip=False)
    lean = mod.Config("tiny-lean-host", "llama-tiny", "h200-sxm", 1, 9, 0, 64, 2, clip=False, nonfinite="stop")
    monkeypatch.setattr(mod, "CONFIGS", (fits, two, too_small, floor, lean))
    out = tmp_path / "record.json"
    assert mod.main(["--out", str(out), "--allow-dirty"]) == 0
    records = {r["name"]: r for r in json.loads(out.read_text())}
    ok = records["tiny-1"]
    assert ok["predicted_step_s"] > 0 and ok["tokens_per_step"] == 128
    assert ok["predicted_tokens_per_s"] == 128 / ok["predicted_step_s"]
    saved = tmp_path / ok["plan_file"]
    assert saved.exists() and "explanation" not in json.loads(saved.read_text())
    import hashlib
    assert ok["plan_sha256"] == hashlib.sha256(saved.read_bytes()).hexdigest()
    assert ok["chosen_by"]
    # no plan: the record says why and the smallest device budget that would plan
    bad = records["tiny-too-small"]
    assert "predicted_step_s" not in bad and bad["min_budget_bytes"] > 0.001 * 2**30 and bad["error"]
    # budget 0: planned at the smallest budget that plans, which the record names
    lowest = records["tiny-floor"]
    assert lowest["floor_bytes"] > 0 and lowest["peak_device_bytes"] <= lowest["floor_bytes"]
    # host 0: planned at the least host RAM that plans (gradients streamed, copies made on load where they count)
    leanest = records["tiny-lean-host"]
    assert 0 < leanest["peak_host_bytes"] <= leanest["leanest_host_bytes"] < ok["peak_host_bytes"]
    eff = mod.strong_scaling(list(records.values()))
    assert eff["tiny-1"] == 1.0 and 0 < eff["tiny-2"] <= 1.05  # the same tokens per step over two ranks
    table = mod.render(list(records.values()))
    assert "no plan" in table and "tiny-2" in table


def test_unknown_configuration_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        mod.main(["--only", "no-such", "--allow-dirty"])
    assert "no-such" in capsys.readouterr().err
