"""Prediction tables say which rows were used in fitting the preset and score the held-out ones, before the
run and with today's model on the same plans."""

import pytest

from benchmarks.common.fit_set import first_runs, used_in_fitting
from benchmarks.predict_vs_measured.run import render


def _row(shape, before_error, today_error, fitted):
    """A point measured at 1.0 s, predicted before the run and replayed with today's model (None: its plan
    was not found) with those relative errors (measured / predicted - 1)."""
    return {"record": "r.json", "shape": shape, "tokens_per_step": 4096, "budget_bytes": 24 * 2**30,
            "device_name": "NVIDIA H200", "preset": "h200-sxm", "ran_commit": "abc1234", "measured_median_s": 1.0,
            "predicted_before_s": 1 / (1 + before_error),
            "today_s": None if today_error is None else 1 / (1 + today_error), "fitted": fitted}


def test_the_4b_shape_fitted_the_h200_preset_and_nothing_else():
    assert used_in_fitting({"shape": "4b", "tokens_per_step": 16384}, "h200-sxm")
    assert used_in_fitting({"tokens_per_step": 4096}, "h200-sxm")  # records before the shape field: 4b
    assert not used_in_fitting({"shape": "8b"}, "h200-sxm")
    assert not used_in_fitting({"shape": "4b"}, "/path/calibrated.json")  # a calibrated profile


def test_each_plan_is_judged_once_at_its_first_run():
    rows = [{"plan_sha256": "a", "measure_start_utc": "2026-01-02", "n": 1},
            {"plan_sha256": "b", "measure_start_utc": "2026-01-03", "n": 2},
            {"plan_sha256": "a", "measure_start_utc": "2026-01-01", "n": 3},  # a's first run, listed later
            {"measure_start_utc": "2026-01-01", "n": 4}, {"measure_start_utc": "2026-01-01", "n": 5}]  # no sha: each its own
    assert [r["n"] for r in first_runs(rows)] == [2, 3, 4, 5]


def test_a_plan_run_twice_is_scored_once():
    first = dict(_row("8b", 0.02, 0.02, False), plan_sha256="p", measure_start_utc="2026-01-01")
    again = dict(_row("8b", 0.3, 0.3, False), plan_sha256="p", measure_start_utc="2026-01-02")
    assert "within 10%: 1 of 1 as predicted before the run; 1 of 1 with today's model" in render([again, first])


def test_held_out_rows_are_scored_apart():
    text = render([_row("4b", 0.02, 0.02, True), _row("8b", 0.175, 0.05, False), _row("8b", -0.05, -0.2, False),
                   _row("8b", 0.01, None, False)])
    assert text.count("| fitted |") == 1 and text.count("| held out |") == 3
    assert "within 10%: 1 of 2 as predicted before the run; 1 of 2 with today's model" in text
    assert "1 held-out point(s) without their plan" in text and "plan not found" in text


def test_a_profile_is_scored_on_its_cards_points_only():
    on_card = dict(_row("8b", 0.25, 0.2, False), profile_s={"calibrated:X": 1 / 1.05, "calibrated:X + fits": 1 / 1.2})
    elsewhere = dict(_row("8b", 0.05, 0.05, False), profile_s={})
    text = render([on_card, elsewhere])
    assert "`calibrated:X` s (error)" in text and "0.952 (+5.0%)" in text and "| – |" in text
    assert "Under `calibrated:X`, on the 1 held-out points of its card: 1 (before the run: 0; hindsight)" in text
    assert "Under `calibrated:X + fits`, on the 1 held-out points of its card: 0 (before the run: 0" in text
    assert "Under" not in render([elsewhere])


def test_the_h100_profile_is_its_calibration_with_the_h200_step_fits():
    """The committed profile is exactly `slidedp calibrate`'s output on the H100 host with the h200-sxm
    coefficients fitted to steps, and plans solved with it count as predictions for the H100."""
    from dataclasses import replace
    from pathlib import Path

    from benchmarks.common.fit_set import card_of
    from slidedp import Hardware
    from slidedp.costmodel.hardware import PRESETS, STEP_FITTED, with_step_fits

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "predict_vs_measured" / "results"
    calibrated = Hardware.load(results / "2026-12-06-h100-calibrated-profile.json")
    profile = Hardware.load(results / "2026-12-06-h100-profile-with-h200-step-fits.json")
    # made when the step fits also took the CPU AdamW's fractions beside copies (calibrate's measurement of
    # them ended its copies early then: 0.93 where a step's round of updates ran at 0.66)
    fractions = ("cpu_adamw_contended_fraction", "cpu_adamw_backward_fraction")
    then = {f: getattr(PRESETS["h200-sxm"], f) for f in fractions}
    assert profile == replace(with_step_fits(calibrated), **then)
    assert all(getattr(profile, f) == getattr(PRESETS["h200-sxm"], f) for f in STEP_FITTED + fractions)
    assert profile.cpu_adamw_params_per_s == calibrated.cpu_adamw_params_per_s  # the machine's own
    assert card_of(profile.name) == card_of(calibrated.name) == "NVIDIA H100 80GB HBM3"
    assert card_of("h200-sxm") == "H200" and card_of(None) == "?"
    # the step fits came from the h200-sxm's Qwen3-4B runs: the 4b shape is not held out for the profile
    assert used_in_fitting({"shape": "4b"}, profile.name) and not used_in_fitting({"shape": "8b"}, profile.name)
    assert not used_in_fitting({"shape": "4b"}, calibrated.name)
    # with its compiled blocks scaled to another model's block: the same card, the same fit
    scaled = with_step_fits(calibrated, block_ratio=0.8, block="qwen3-1.7b")
    assert card_of(scaled.name) == "NVIDIA H100 80GB HBM3"
    assert used_in_fitting({"shape": "4b"}, scaled.name) and not used_in_fitting({"shape": "1.7b"}, scaled.name)


def test_phases_set_each_points_pass_beside_its_replayed_compute(monkeypatch):
    """predict_vs_measured/phases.py: a registered point's steady wait and pass are its record's, and its
    compute is the lane the replay of its registered plan keeps busy."""
    import statistics

    from benchmarks.common import fit_set
    from benchmarks.predict_vs_measured import phases

    rows = fit_set.prediction_rows(phases.RESULTS)
    point = next(r for r in rows if r["record"] == "2026-12-06-registered-h100.json" and r["shape"] == "llama3b"
                 and r["tokens_per_step"] == 4096)
    monkeypatch.setattr(phases, "prediction_rows", lambda results: [point])
    (row,) = phases.phase_rows()
    steady = point["step_info"][2:-1]
    assert row["pass_s"] == statistics.median(s["pass_s"] for s in steady)
    assert row["wait_s"] == statistics.median(s["wait_s"] for s in steady)
    assert 0 < row["predicted_compute_s"] < row["predicted_s"] and row["bound"] == "h2d"
    assert row["vocab_streamed"] == ["epilogue"]  # as its plan says
    assert 0 <= row["copies_share"] <= 1
    assert "| llama3b | 4,096 | 12.0 | h2d | epilogue |" in phases.render([row])


def test_the_copies_share_of_the_cpu_round_counts_only_time_both_copy_lanes_run():
    """phases.copies_share: of the CPU lane's 10 busy ticks, 3 have H2D and D2H running at once (H2D alone,
    D2H alone and another rank's copies do not count); a replay without CPU updates has no share."""
    from slidedp.scheduler.oracles.timeline import Event
    from benchmarks.predict_vs_measured.phases import copies_share

    def ev(lane, start, end, rank=0):
        return Event(rank, lane, "op", 0, 0, start, end)

    events = [ev("cpu_update", 0, 4), ev("cpu_update", 10, 16),
              ev("h2d", 0, 3), ev("h2d", 2, 6), ev("d2h", 1, 2), ev("d2h", 5, 12),  # both: 1-2 and 5-6
              ev("h2d", 12, 20), ev("d2h", 14, 15), ev("d2h", 15, 16),  # both: 14-16
              ev("d2h", 0, 16, rank=1), ev("h2d", 0, 16, rank=1)]
    assert copies_share(events) == pytest.approx(3 / 10)
    assert copies_share([ev("h2d", 0, 3), ev("d2h", 0, 3)]) is None


def test_each_shapes_own_profile_replays_that_shapes_points_on_its_card(monkeypatch):
    """--profile-for SHAPE=PROFILE: a shape's points that ran on the profile's card are replayed under it,
    in one column for every shape; other shapes' points and other cards' are not."""
    import types

    from benchmarks.predict_vs_measured import run

    def point(shape, card):
        return {"record": "r.json", "shape": shape, "tokens_per_step": 4096, "budget_bytes": 2**30,
                "device_name": card, "preset": "p", "git_commit": "abc", "plan_sha256": shape + card,
                "median_step_s": 1.0, "predicted_step_s": 1.0, "fitted": False}

    rows = [point("1.7b", "NVIDIA H100 80GB HBM3"), point("8b", "NVIDIA H100 80GB HBM3"), point("1.7b", "NVIDIA H200")]
    profile = types.SimpleNamespace(name="calibrated:NVIDIA H100 80GB HBM3 + h200-sxm step fits, compiled blocks x0.870 (qwen3-1.7b)")
    monkeypatch.setattr(run, "prediction_rows", lambda results: rows)
    monkeypatch.setattr(run.slidedp.Hardware, "load", staticmethod(lambda path: profile))
    monkeypatch.setattr(run.slidedp.Plan, "from_dict", staticmethod(lambda data: data))
    monkeypatch.setattr(run.bench, "empty_model", lambda shape, **kw: shape)
    monkeypatch.setattr(run.slidedp, "predict", lambda model, plan, hardware=None: 0.5 if hardware is profile else 1.0)
    out = run.replay_rows({r["plan_sha256"]: {} for r in rows}, profile_for={"1.7b": "own.json"})
    assert [r["profile_s"] for r in out] == [{run.PER_SHAPE: 0.5}, {}, {}]


def test_a_what_if_host_floor_moves_only_the_blocks_it_binds():
    """common/profiles.with_compiled_host_floor: the profile's compiled blocks take at least the floor a
    micro-batch; a block whose GPU time is longer keeps it, a short one takes the floor; the name says so."""
    from dataclasses import replace

    from benchmarks.common.profiles import with_compiled_host_floor
    from slidedp.costmodel import ops
    from slidedp.costmodel.hardware import PRESETS
    from slidedp.ir.graph import LayerCosts

    hw = replace(PRESETS["h100-sxm"], compiled_block_efficiency=0.6)
    floored = with_compiled_host_floor(hw, 1.5e-3, 3e-3)
    assert floored.name.endswith("compiled host floor 1.5 / 3 ms (what-if)")
    big, small = LayerCosts(flops_fwd=4e12, flops_bwd=8e12), LayerCosts(flops_fwd=4e10, flops_bwd=8e10)
    for costs, bound in ((big, False), (small, True)):
        before = ops.block_backward_time_s(costs, hw, 4, recompute=True, compiled=True)
        after = ops.block_backward_time_s(costs, floored, 4, recompute=True, compiled=True)
        assert after == (pytest.approx(4 * 4.5e-3) if bound else pytest.approx(before))
