"""benchmarks/predict_vs_measured/device_peaks.py: a plan that ran, lowered again as compile lowers it, and
its program's peak set beside the measured peaks."""

from __future__ import annotations

import slidedp
from benchmarks.predict_vs_measured.device_peaks import peak_bytes, render
from benchmarks.predict_vs_measured.register import register


def test_a_plan_lowered_again_peaks_where_its_solve_said(tmp_path):
    """Unchanged code lays a plan's decisions out at the peak its own explanation holds, and lowers them into a
    program within it: what the hindsight sets beside a measured peak is the model's, not the replay's."""
    (row,) = register([("tiny", 64, "1GiB")], "cpu", None, folder=tmp_path, steps=3, precision="fp32")
    plan = slidedp.Plan.load(tmp_path / f"{row['plan_sha256'][:16]}.json")
    today, program = peak_bytes(plan, "tiny")
    assert today == plan.explanation.peak_device_bytes > 0 and 0 < program <= today


def test_the_table_counts_programs_under_the_allocated_peak():
    GiB = 2**30
    row = dict(shape="tiny", tokens_per_step=64, budget_bytes=GiB, device_name="card", ran_commit="abc1234",
               reserved_bytes=None, record="r.json")
    rows = [{**row, "allocated_bytes": GiB // 2, "predicted_before_bytes": GiB, "today_bytes": GiB // 4,
             "program_bytes": GiB // 4},
            {**row, "allocated_bytes": GiB // 2, "predicted_before_bytes": GiB, "today_bytes": 3 * GiB // 4,
             "program_bytes": GiB // 2},
            {**row, "allocated_bytes": GiB // 2, "predicted_before_bytes": GiB, "today_bytes": None,
             "program_bytes": None}]
    text = render(rows)
    assert text.count("| tiny |") == 2  # the plan not found is left out
    assert "Predicted before the run: under the allocated peak on 0 of 2, over it by +0.50 GiB" in text
    assert "Today's model: under the allocated peak on 1 of 2, over it by +0.25 GiB at the median (-0.25 to +0.25)" \
        in text
    assert "Today's program: under the allocated peak on 1 of 2, over it by +0.00 GiB" in text
