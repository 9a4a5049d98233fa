"""The DeepSpeed ZeRO-Offload baselines (benchmarks/common/deepspeed_zero.py) without DeepSpeed: the
config each system runs with, and a missing DeepSpeed or an op that does not build becoming the
point's record instead of ending the run. With DeepSpeed installed, a slow test runs the three
systems on a tiny model on the CPU (skipped without it)."""

from __future__ import annotations

import json
import sys

import pytest

import benchmarks.single_gpu_throughput.run as bench
from benchmarks.common import deepspeed_zero as dz
from benchmarks.common.model import BETAS, EPS, LR, WEIGHT_DECAY

ADAM = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def test_zero2_config_offloads_the_optimizer_to_pinned_cpu_memory():
    c = dz.zero_offload_config(2, micro_rows=1, accumulation_steps=4, max_grad_norm=1.0, hidden=2560, **ADAM)
    z = c["zero_optimization"]
    assert z["stage"] == 2 and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in z and z["overlap_comm"] and z["contiguous_gradients"]
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == dz.ZERO2_BUCKET
    assert c["train_batch_size"] == 4 and c["gradient_accumulation_steps"] == 4
    assert c["train_micro_batch_size_per_gpu"] == 1
    assert c["gradient_clipping"] == 1.0 and c["bf16"] == {"enabled": True}
    opt = c["optimizer"]
    assert opt["type"] == "AdamW" and opt["params"]["torch_adam"] is False  # DeepSpeedCPUAdam, not torch's
    assert opt["params"]["lr"] == LR and opt["params"]["betas"] == list(BETAS)
    json.dumps(c)  # a config DeepSpeed can take as JSON too


def test_zero3_config_with_and_without_parameter_offload():
    h = 2560
    c = dz.zero_offload_config(3, micro_rows=2, accumulation_steps=2, max_grad_norm=None, hidden=h, **ADAM)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and "offload_param" not in z and c["gradient_clipping"] == 0.0
    assert z["reduce_bucket_size"] == h * h and z["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert z["stage3_param_persistence_threshold"] == 10 * h
    p = dz.zero_offload_config(3, micro_rows=1, accumulation_steps=1, max_grad_norm=1.0, hidden=h, offload_param=True,
                               pin_memory=False, bf16=False, **ADAM)["zero_optimization"]
    assert p["offload_param"] == {"device": "cpu", "pin_memory": False} == p["offload_optimizer"]


def test_config_refuses_what_deepspeed_does_not_offer():
    with pytest.raises(ValueError, match="stage 2 or 3"):
        dz.zero_offload_config(1, micro_rows=1, accumulation_steps=1, max_grad_norm=1.0, hidden=8, **ADAM)
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        dz.zero_offload_config(2, micro_rows=1, accumulation_steps=1, max_grad_norm=1.0, hidden=8,
                               offload_param=True, **ADAM)


def test_every_deepspeed_system_is_in_the_benchmark():
    for system, (stage, offload_param) in dz.SYSTEMS.items():
        assert system in bench.SYSTEMS and bench.NAMES[system].startswith(f"DeepSpeed ZeRO-{stage}")
        assert hasattr(bench.systems.Point, "setup_" + system)


def test_a_build_failure_keeps_the_compiler_output():
    log = "Error building extension 'cpu_adam'\n" + "x" * 10_000 + "\ncpu_adam_impl.cpp:1: error: the real cause"
    text = dz.build_failure_text(RuntimeError(log))
    assert text.startswith("DeepSpeedCPUAdam op (cpu_adam) failed to build or load: RuntimeError: Error building")
    assert text.endswith("the real cause") and len(text) < 6500
    assert dz.build_failure_text(RuntimeError("short")).endswith("RuntimeError: short")


def test_the_driver_passes_the_checkpoint_option_to_each_point(monkeypatch, tmp_path):
    seen = []
    def run_child(cmd, result, timeout, fallback):
        seen.append(cmd)
        return {**fallback, "error": "not run"}

    monkeypatch.setattr(bench, "run_child", run_child)
    out = tmp_path / "r.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--tokens", "64", "--systems", "deepspeed_zero2_offload",
                       "--deepspeed-checkpoint", "all", "--out", str(out), "--allow-dirty"]) == 0
    cmd = seen[0]
    assert cmd[cmd.index("--system") + 1] == "deepspeed_zero2_offload"
    assert cmd[cmd.index("--deepspeed-checkpoint") + 1] == "all"


def test_missing_deepspeed_becomes_the_points_error(monkeypatch, tmp_path):
    """The point's process records why (and how to install it) and exits 1; the driver goes on."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    result = tmp_path / "record.json"
    code = bench.main(["--worker", "--system", "deepspeed_zero3_offload", "--tokens", "64", "--shape", "tiny",
                       "--device", "cpu", "--steps", "1", "--result-file", str(result), "--command", "test",
                       "--out", str(tmp_path / "out.json")])
    r = json.loads(result.read_text())
    assert code == 1 and r["system"] == "deepspeed_zero3_offload"
    assert r["error"].startswith("deepspeed not importable (ModuleNotFoundError") and "[deepspeed]" in r["error"]
    assert r["tokens_per_s"] is None and r["measured_step_s"] is None
    assert bench.render_table([r]).count("deepspeed not importable") == 1
    assert "did not run (deepspeed not importable" in " ".join(bench.render_section([r]).split())


@pytest.mark.slow
def test_deepspeed_systems_train_the_same_steps_on_cpu(tmp_path):
    """Each ZeRO-Offload system on a tiny model on the CPU (DeepSpeed's CPU accelerator, gloo, fp32,
    DeepSpeedCPUAdam JIT-built: minutes the first time) trains the same steps as GPU-resident PyTorch."""
    pytest.importorskip("deepspeed")
    from tests.benchmarks.test_single_gpu_throughput import run_smoke, same_training

    records, _ = run_smoke(tmp_path / "ds.json", "gpu_resident", *dz.SYSTEMS, extra=["--timeout-s", "600"])
    for r in records:
        assert r["error"] is None, (r["system"], r["error"])
    assert all("DeepSpeedCPUAdam" in r["optimizer"] for r in records[1:])
    same_training(records)
