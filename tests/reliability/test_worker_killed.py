"""A rank's worker process killed during `slidedp train world_size=2`: the run stops naming the
rank, nothing is left behind, and resuming reproduces the uninterrupted run bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slidedp.train.config import load_config
from slidedp.train.job import list_checkpoints, run
from tests.reliability.conftest import REPO, overrides, subprocess_env
from tests.reliability.test_signals_and_kill import assert_same_final_state


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def rank_workers(pid: int) -> list[int]:
    """The controller's spawned rank processes (their command line runs multiprocessing's spawn_main)."""
    found = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(child)
        except FileNotFoundError:
            pass
    return found


@pytest.fixture(scope="module")
def uninterrupted(rel_model_dir, rel_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted-2-ranks")
    run(load_config(None, overrides(rel_model_dir, rel_data, out, "world_size=2")))
    return out


def start_after_three_steps(rel_model_dir, rel_data, out, steps: int = 3):
    """`slidedp train world_size=2` in its own session (process group), once it has logged `steps` steps."""
    cli = overrides(rel_model_dir, rel_data, out, "world_size=2")
    proc = subprocess.Popen([sys.executable, "-m", "slidedp.cli", "train", *cli], env=subprocess_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.005)
    return proc, cli


def test_a_killed_worker_stops_the_run_and_resume_is_exact(uninterrupted, rel_model_dir, rel_data, tmp_path):
    out = tmp_path / "run"
    proc, cli = start_after_three_steps(rel_model_dir, rel_data, out)
    workers = rank_workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("slidedp train: error: rank 1 failed: its process exited")
    for pid in workers:  # every rank process is gone
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    checkpoint_step = list_checkpoints(out)[-1][0]  # step 2 at least: written before the kill
    assert checkpoint_step >= 2

    summary = run(load_config(None, cli + ["resume=true"]))
    assert summary["start_step"] == checkpoint_step
    assert_same_final_state(uninterrupted, out)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6


def test_ctrl_c_to_the_process_group_stops_at_a_step_boundary(uninterrupted, rel_model_dir, rel_data, tmp_path):
    """SIGINT to every process of the run (what a terminal's Ctrl-C does): the workers ignore it, the
    controller finishes the step, checkpoints and stops; resuming reproduces the uninterrupted run."""
    out = tmp_path / "run"
    proc, cli = start_after_three_steps(rel_model_dir, rel_data, out, steps=1)  # steps take ~10 ms: signal early
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stderr
    if proc.returncode == 0:  # the signal landed in the last of the 6 steps: that step ends the run anyway
        assert "SIGINT received" in stderr and "step     6/6" in stderr, stderr[-3000:]
        assert_same_final_state(uninterrupted, out)
        return
    assert proc.returncode == 130, stderr[-3000:]
    stopped_at = list_checkpoints(out)[-1][0]
    summary = run(load_config(None, cli + ["resume=true"]))
    assert summary["start_step"] == stopped_at
    assert_same_final_state(uninterrupted, out)
