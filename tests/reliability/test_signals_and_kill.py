"""Faults during a run: SIGINT/SIGTERM in a step, SIGKILL while a checkpoint is written.

Each interrupted run is a real `slidedp train` process (tests/reliability/faulty_train.py); the
resumed run must give bitwise the uninterrupted run's weights, moments and losses (CPU, fp32).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from slidedp.run.checkpoint import read_master_weights, verify_checkpoint
from slidedp.train.config import load_config
from slidedp.train.job import list_checkpoints, run, stop_on_signals
from tests.reliability.conftest import REPO, overrides, start_train, subprocess_env


@pytest.fixture(scope="module")
def uninterrupted(rel_model_dir, rel_data, tmp_path_factory):
    """6 steps in one go (checkpoints at 2, 4, 6)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    summary = run(load_config(None, overrides(rel_model_dir, rel_data, out)))
    return out, summary


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_final_state(a, b):
    """The last checkpoints of two runs hold the same bits (weights, both moments, AdamW step)."""
    ca, cb = list_checkpoints(a)[-1][1], list_checkpoints(b)[-1][1]
    wa, wb = read_master_weights(ca), read_master_weights(cb)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    fa = json.loads((ca / "manifest.json").read_text())["files"]
    fb = json.loads((cb / "manifest.json").read_text())["files"]
    for name in fa:
        if name.startswith("state/") or name == "rng.safetensors":
            assert fa[name]["sha256"] == fb[name]["sha256"], name
    ea, eb = json.loads((ca / "engine.json").read_text()), json.loads((cb / "engine.json").read_text())
    assert ea["step"] == eb["step"] and ea["skipped_steps"] == eb["skipped_steps"]
    assert losses(a) == losses(b)


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143)])  # SIGINT: the external test below
def test_signal_in_a_step_stops_at_the_boundary_with_a_checkpoint_and_resume_is_exact(
        signame, code, uninterrupted, rel_model_dir, rel_data, tmp_path):
    out = tmp_path / "run"
    args = overrides(rel_model_dir, rel_data, out)
    proc = start_train(args, SLIDEDP_FAULT_SIGNAL_AT_STEP=3, SLIDEDP_FAULT_SIGNAL=signame)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"slidedp train: stopped by {signame} after step 3 of 6: checkpoint "), last
    assert "resume=true" in last
    assert f"{signame} received: stopping after this step" in stderr
    # step 3 finished (its metrics record is there) and was checkpointed although save_every=2
    assert [s for s, _ in list_checkpoints(out)] == [2, 3]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    verify_checkpoint(list_checkpoints(out)[-1][1])
    summary = run(load_config(None, args + ["resume=true"]))
    assert summary["start_step"] == 3 and summary["steps"] == 3
    assert_same_final_state(uninterrupted[0], out)


def test_external_sigint_to_the_slidedp_command(rel_model_dir, rel_data, tmp_path):
    """The `slidedp` command (`python -m slidedp`), interrupted from outside while it trains (Ctrl-C); resuming
    to 2 steps past the stop gives bitwise the run that went there in one go."""
    out = tmp_path / "run"
    args = overrides(rel_model_dir, rel_data, out, "max_steps=100000", "save_every=0")  # constant lr after warm-up
    proc = subprocess.Popen([sys.executable, "-m", "slidedp", "train", *args],
                            env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    (step, folder), = list_checkpoints(out)
    assert f"stopped by SIGINT after step {step} of 100000: checkpoint {folder}" in stderr
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
    last_record = json.loads(metrics.read_text().splitlines()[-1])
    assert last_record["step"] == step  # no step was started after the checkpoint
    verify_checkpoint(folder)
    run(load_config(None, args[:-2] + [f"max_steps={step + 2}", "resume=true"]))
    reference = tmp_path / "reference"
    run(load_config(None, overrides(rel_model_dir, rel_data, reference, f"max_steps={step + 2}", "save_every=0")))
    assert_same_final_state(reference, out)


def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one(
        uninterrupted, rel_model_dir, rel_data, tmp_path):
    out = tmp_path / "run"
    marker = tmp_path / "paused"
    args = overrides(rel_model_dir, rel_data, out)
    proc = start_train(args, SLIDEDP_FAULT_PAUSE_SAVE_AT_STEP=4, SLIDEDP_FAULT_MARKER=marker)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.kill()  # SIGKILL, in the middle of writing step 4's checkpoint
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    half = [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert half and not (half[0] / "manifest.json").exists()  # the unfinished one, not trusted
    assert [s for s, _ in list_checkpoints(out)] == [2]
    verify_checkpoint(list_checkpoints(out)[-1][1])  # the previous checkpoint is intact
    summary = run(load_config(None, args + ["resume=true"]))  # loads it, removes the half one
    assert summary["start_step"] == 2 and summary["steps"] == 4
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert_same_final_state(uninterrupted[0], out)


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs before this returns
    assert signal.getsignal(signal.SIGINT) is before
