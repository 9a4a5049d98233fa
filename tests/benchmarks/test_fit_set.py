"""Prediction tables say which rows were used in fitting the preset and score the held-out ones."""

from benchmarks.common.fit_set import used_in_fitting
from benchmarks.predict_vs_measured.run import render


def _row(shape, error, fitted):
    return {"shape": shape, "tokens_per_step": 4096, "activation": {"recompute": 36}, "measured_step_s": 1.0,
            "steady_step_s": None, "predicted_step_s": 1.0 + error, "error": error, "measured_pass_s": None,
            "predicted_pass_s": 0.9, "predicted_in_run_s": None, "used_in_fitting": fitted}


def test_the_4b_shape_fitted_the_h200_preset_and_nothing_else():
    assert used_in_fitting({"shape": "4b", "tokens_per_step": 16384}, "h200-sxm")
    assert used_in_fitting({"tokens_per_step": 4096}, "h200-sxm")  # records before the shape field: 4b
    assert not used_in_fitting({"shape": "8b"}, "h200-sxm")
    assert not used_in_fitting({"shape": "4b"}, "/path/calibrated.json")  # a calibrated profile


def test_held_out_rows_are_scored_apart():
    text = render([_row("4b", 0.02, True), _row("8b", 0.175, False), _row("8b", -0.05, False)])
    assert text.count("| yes |") == 1 and text.count("| no |") == 2
    assert "within 10%: 1 of 2" in text
