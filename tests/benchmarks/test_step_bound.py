"""benchmarks/tools/step_bound.py: a saved plan's step taken apart, and the step with some updates free."""

import dataclasses

import pytest
import torch

import slidedp
from benchmarks.common.model import empty_model
from benchmarks.tools import step_bound

# every update on the host's CPU, as gradients land: the CPU's work is on the step's critical path
CPU_BOUND = slidedp.SolverOptions(streamed_layers=0, device_state_blocks=0, device_state_prologue=False)


def test_the_plans_own_step_its_critical_path_and_free_updates(tmp_path, capsys):
    model = empty_model("1.7b", dtype=torch.bfloat16, device="cpu")  # parameters on the meta device
    plan = slidedp.plan(model, "8GiB", batch_size=1, seq_len=4096, hardware="h100-sxm", max_grad_norm=None,
                        nonfinite="stop", solver_options=CPU_BOUND)
    plan.save(tmp_path / "plan.json")
    out = step_bound.main([str(tmp_path / "plan.json"), "--shape", "1.7b", "--free", "prologue",
                           "--free-last-blocks", "4"])
    assert out["step_s"] == pytest.approx(plan.predicted_step_time_s, abs=1e-4)
    assert "as planned: step" in capsys.readouterr().out
    for r in [out, *out["what_if"]]:
        runs = r["critical_path"]
        assert runs and runs[-1]["end_ms"] == pytest.approx(r["step_s"] * 1e3, abs=0.2)
        assert all(a["end_ms"] <= b["start_ms"] + 1e-6 for a, b in zip(runs, runs[1:]))
    n = len(plan.schedule.decisions)
    prologue, four = out["what_if"]
    assert prologue["free_layers"] == [0] and four["free_layers"] == [0, *range(n - 5, n - 1)]
    # the CPU-bound plan: each update taken off the CPU shortens its lane, and the step with it
    assert out["lanes_ms"]["cpu_update"] > prologue["lanes_ms"]["cpu_update"] > four["lanes_ms"]["cpu_update"]
    assert out["step_s"] > prologue["step_s"] >= four["step_s"]


def test_a_layer_that_makes_its_copy_on_load_is_freed_with_its_copy_on_the_device():
    """State on the device makes the layer's delivery copy there: a prologue planned with its copy made on
    load (host state without it) is freed as one whose copy is kept within the device."""
    model = empty_model("1.7b", dtype=torch.bfloat16, device="cpu")
    plan = slidedp.plan(model, "8GiB", batch_size=1, seq_len=4096, hardware="h100-sxm", max_grad_norm=None,
                        solver_options=CPU_BOUND)
    plan = plan.replace(decisions=tuple(dataclasses.replace(d, host_copy="on_load") for d in plan.decisions))
    assert not plan.problems() and not plan.schedule.device_state
    out = step_bound.bound(plan, "1.7b", prologue=True)
    assert out["what_if"][0]["lanes_ms"]["cpu_update"] < out["lanes_ms"]["cpu_update"]
