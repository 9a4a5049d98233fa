"""`slidedp train` under torchrun on several hosts, simulated on one machine: two launches of
`torchrun --nnodes 2 --node-rank K ... -m slidedp train CONFIG` (rendezvous on 127.0.0.1) sharing one
run folder. The same config trains as one process does (the same global batches, AdamW on them);
rank 0 alone writes the run's files, each host its own layer files of a checkpoint; a run resumes on
the same hosts bitwise, and on another number of hosts through resharding; a world_size that
disagrees with the launch, a missing link and a run folder that is not shared are refused."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slidedp.run.checkpoint import read_engine_meta, read_master_weights, verify_checkpoint
from slidedp.train.config import load_config
from slidedp.train.export import export_checkpoint
from slidedp.train.job import list_checkpoints, run
from tests.train.conftest import tiny_jsonl, tiny_model_dir, tiny_tokenizer  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                                reason="no torchrun")
STEPS = 4
ROWS = 4  # rows of a global batch: batch_size x grad_accum x world_size


def keys(model_dir, data, out, *overrides) -> list[str]:
    return [f"model={model_dir}", f"data={data}", f"output_dir={out}", f"max_steps={STEPS}", "grad_accum=2",
            "seq_len=32", "lr=5e-3", "warmup_steps=2", "weight_decay=0.1", "max_grad_norm=1.0", "val_fraction=0.25",
            "val_every=2", "save_every=2", "keep_last=3", "precision=fp32", "device=cpu", "progress=false",
            "tensorboard=false", "link=eth-1x100", *overrides]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(hosts: int, per_host: int, args: list[str], *, timeout: float = 600, host_args: dict | None = None,
           host_env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """`slidedp train ARGS` on `hosts` launches of torchrun (one a host) of `per_host` ranks each;
    `host_args` / `host_env`: {host: more overrides / environment} of one host's launch (with an
    environment, through tests/reliability/faulty_train.py, which injects the faults it names)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    procs = []
    for k in range(hosts):
        extra_env = (host_env or {}).get(k, {})
        entry = [str(ROOT / "tests/reliability/faulty_train.py")] if extra_env else ["-m", "slidedp"]
        procs.append(subprocess.Popen(
            [TORCHRUN, f"--nnodes={hosts}", f"--node-rank={k}", f"--nproc-per-node={per_host}",
             "--master-addr=127.0.0.1", f"--master-port={port}", *entry, "train", *args,
             *(host_args or {}).get(k, [])],
            env={**env, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def ok(results) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def latest_weights(out: Path) -> dict[str, torch.Tensor]:
    return read_master_weights(list_checkpoints(out)[-1][1])


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tiny_jsonl, tmp_path_factory):
    """The reference: the same config in one process, one rank (its global batch whole)."""
    out = tmp_path_factory.mktemp("one")
    run(load_config(None, keys(tiny_model_dir, tiny_jsonl[0], out, "batch_size=2")))
    return out


def test_two_hosts_train_as_one_process_writing_the_run_once(one_process, tiny_model_dir, tiny_jsonl, tmp_path):
    out = tmp_path / "hosts"
    results = launch(2, 1, keys(tiny_model_dir, tiny_jsonl[0], out, "batch_size=1"))
    ok(results)
    # the same losses and weights as one process on the same global batches (AdamW on each)
    hosts, one = metrics(out), metrics(one_process)
    assert [r["step"] for r in hosts] == list(range(1, STEPS + 1))  # one writer: each step once
    assert [r["loss"] for r in hosts] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["val_loss"] for r in hosts if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in one if "val_loss" in r], rel=1e-5)
    assert [r["trained_tokens"] for r in hosts] == [r["trained_tokens"] for r in one]
    w_hosts, w_one = latest_weights(out), latest_weights(one_process)
    assert w_hosts.keys() == w_one.keys()
    for name in w_one:
        torch.testing.assert_close(w_hosts[name], w_one[name], rtol=1e-4, atol=2e-5, msg=name)
    # the run's files once, by rank 0; every checkpoint with a layer file per host in its manifest
    config = json.loads((out / "config.json").read_text())
    assert config["engine"]["world_size"] == 2
    assert (out / "plan.json").is_file()
    assert [step for step, _ in list_checkpoints(out)] == [2, 4]
    for _, folder in list_checkpoints(out):
        files = verify_checkpoint(folder)["files"]
        assert any(".host-000-of-002" in f for f in files) and any(".host-001-of-002" in f for f in files)
        assert "trainer_state.json" in files and "hf/tokenizer_config.json" in files
        assert json.loads((folder / "trainer_state.json").read_text())["hosts"] == 2
    assert read_engine_meta(list_checkpoints(out)[-1][1])["step"] == STEPS
    assert not list((out / "checkpoints").glob(".*"))  # no temporary folder left
    # `slidedp export` reads the hosts' checkpoint on one machine: the master weights exactly
    export_checkpoint(out, tmp_path / "export", dtype="fp32")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported and all(torch.equal(value, w_hosts[name]) for name, value in exported.items())
    # one host speaks: the other host's rank prints nothing of the run
    assert "[slidedp] done: loss" in results[0].stderr and "[slidedp]" not in results[1].stderr, results[1].stderr


def test_a_world_size_that_disagrees_with_the_launch_is_refused(tiny_model_dir, tiny_jsonl, tmp_path):
    results = launch(2, 1, keys(tiny_model_dir, tiny_jsonl[0], tmp_path / "bad", "batch_size=1", "world_size=4"),
                     timeout=120)
    for r in results:
        assert r.returncode != 0
        assert "config key 'world_size' is 4, but torchrun started WORLD_SIZE=2 processes (2 host(s) x 1 rank(s))" \
            in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "bad").exists()  # refused before the run folder is made


def test_hosts_with_run_folders_of_their_own_are_refused(tiny_model_dir, tiny_jsonl, tmp_path, monkeypatch):
    # two folders on one machine stand for a folder that is not shared: each host sees its own
    monkeypatch.setenv("SLIDEDP_SHARED_FOLDER_WAIT_S", "1")
    results = launch(2, 1, keys(tiny_model_dir, tiny_jsonl[0], tmp_path / "host0", "batch_size=1"),
                     host_args={1: [f"output_dir={tmp_path / 'host1'}"]}, timeout=120)
    for r in results:
        assert r.returncode != 0
    assert f"config key 'output_dir': {tmp_path / 'host1'} on host 1 is not the folder rank 0 (host 0) locked" \
        in results[1].stderr, results[1].stderr[-3000:]
    assert "rank 1 (host 1) refused: ValueError: config key 'output_dir'" in results[0].stderr, results[0].stderr[-3000:]
    assert not list_checkpoints(tmp_path / "host0")


def test_several_hosts_need_the_link_and_torchruns_world_size(tiny_model_dir, tiny_jsonl, tmp_path, monkeypatch):
    """Refused before any process group is joined (in this process, with torchrun's environment)."""
    for name, value in dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", RANK="0", GROUP_RANK="0").items():
        monkeypatch.setenv(name, value)
    no_link = load_config(None, keys(tiny_model_dir, tiny_jsonl[0], tmp_path / "a", "batch_size=1", "link="))
    with pytest.raises(ValueError, match="config key 'link': 2 hosts, but the link between them is not given"):
        run(no_link)
    with pytest.raises(ValueError, match="config key 'world_size' is 3, but torchrun started WORLD_SIZE=2"):
        run(load_config(None, keys(tiny_model_dir, tiny_jsonl[0], tmp_path / "a", "world_size=3")))
    with pytest.raises(ValueError, match="config key 'link'"):
        load_config(None, ["link=ib-9x9"])
    assert load_config(None, ["link=1e9"]).engine.link == "1e9"
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_two_hosts_resume_bitwise_and_on_another_number_of_hosts(one_process, tiny_model_dir, tiny_jsonl,
                                                                 tmp_path):
    data = tiny_jsonl[0]
    whole = tmp_path / "whole"
    ok(launch(2, 1, keys(tiny_model_dir, data, whole, "batch_size=1")))
    # 2 steps, then resume to 4 on the same two hosts: bitwise the run in one go
    half = tmp_path / "half"
    ok(launch(2, 1, keys(tiny_model_dir, data, half, "batch_size=1", "max_steps=2")))
    results = launch(2, 1, keys(tiny_model_dir, data, half, "batch_size=1", "resume=true"))
    ok(results)
    assert "resumed at step 2" in results[0].stderr
    assert [r["loss"] for r in metrics(half)] == [r["loss"] for r in metrics(whole)]
    w_whole, w_half = latest_weights(whole), latest_weights(half)
    assert all(torch.equal(w_half[k], w_whole[k]) for k in w_whole)

    # SIGTERM to host 1's rank during step 3: both hosts stop after it, with a checkpoint of step 3;
    # resumed, bitwise the run in one go
    stopped = tmp_path / "stopped"
    results = launch(2, 1, keys(tiny_model_dir, data, stopped, "batch_size=1"),
                     host_env={1: dict(SLIDEDP_FAULT_SIGNAL_AT_STEP="3", SLIDEDP_FAULT_SIGNAL="SIGTERM")})
    assert all(r.returncode != 0 for r in results)
    assert "stopped by SIGTERM after step 3 of 4" in results[0].stderr, results[0].stderr[-3000:]
    assert [step for step, _ in list_checkpoints(stopped)] == [2, 3]
    ok(launch(2, 1, keys(tiny_model_dir, data, stopped, "batch_size=1", "resume=true")))
    assert [r["loss"] for r in metrics(stopped)] == [r["loss"] for r in metrics(whole)]
    w_stopped = latest_weights(stopped)
    assert all(torch.equal(w_stopped[k], w_whole[k]) for k in w_whole)

    # the two hosts' checkpoint of step 2 resumed by one process (2 -> 1 host: resharding)
    two_to_one = tmp_path / "two-to-one"
    step2 = list_checkpoints(half)[0][1]
    assert list_checkpoints(half)[0][0] == 2
    shutil.copytree(step2, tmp_path / "step2")
    run(load_config(None, keys(tiny_model_dir, data, two_to_one, "batch_size=2", f"resume={tmp_path / 'step2'}")))
    w = latest_weights(two_to_one)
    for name in w_whole:
        torch.testing.assert_close(w[name], w_whole[name], rtol=1e-4, atol=2e-5, msg=name)

    # one process's checkpoint of step 2 resumed by two hosts of two ranks (1 -> 2 hosts, 4 ranks)
    one_half = tmp_path / "one-half"
    run(load_config(None, keys(tiny_model_dir, data, one_half, "batch_size=2", "max_steps=2")))
    ok(launch(2, 2, keys(tiny_model_dir, data, one_half, "batch_size=1", "grad_accum=1", "resume=true")))
    w = latest_weights(one_half)
    w_one = latest_weights(one_process)
    for name in w_one:
        torch.testing.assert_close(w[name], w_one[name], rtol=1e-4, atol=2e-5, msg=name)
    assert json.loads((one_half / "config.json").read_text())["engine"]["world_size"] == 4
