"""The run folder and its checkpoints under misuse: two runs on one folder, overwrite with a typo,
export into the wrong place, a damaged latest checkpoint, a resume with changed keys, the RNG
continuation across processes, altered metadata (docs/reliability.md, "Run folder").
"""

import hashlib
import json
import random
import shutil
import time

import numpy as np
import pytest
import torch

from slidedp.cli import main
from slidedp.run.checkpoint import CheckpointError, read_safetensors, verify_checkpoint
from slidedp.train.config import load_config
from slidedp.train.export import export_checkpoint
from slidedp.train.job import list_checkpoints, run
from slidedp.train.runlock import RunFolderLocked
from tests.reliability.conftest import overrides, start_train


@pytest.fixture(scope="module")
def finished(rel_model_dir, rel_data, tmp_path_factory):
    """6 steps of batch 2: checkpoints at 2, 4 and 6."""
    out = tmp_path_factory.mktemp("finished")
    run(load_config(None, overrides(rel_model_dir, rel_data, out)))
    return out


def copy_run(finished, tmp_path, keep=None):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    if keep is not None:
        for step, folder in list_checkpoints(out):
            if step not in keep:
                shutil.rmtree(folder)
    return out


def reseal(folder, rel):
    """A tamperer who also fixes the manifest's size and sha256."""
    data = (folder / rel).read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][rel].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def last_error(capsys, command="train") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"slidedp {command}: error: "), last
    return last


def snapshot(out):
    """Every file of a run folder but the lock file: name -> bytes."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".slidedp.lock"}


# -- 1. one process at a time in a run folder --------------------------------------------------

def test_a_second_run_is_refused_while_the_first_holds_the_folder_and_a_killed_one_frees_it(
        rel_model_dir, rel_data, tmp_path, capsys):
    out = tmp_path / "run"
    marker = tmp_path / "paused"
    args = overrides(rel_model_dir, rel_data, out)
    proc = start_train(args, SLIDEDP_FAULT_PAUSE_SAVE_AT_STEP=4, SLIDEDP_FAULT_MARKER=marker)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():  # the first run holds the folder, half-way through step 4's checkpoint
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run never reached step 4's checkpoint"
            time.sleep(0.2)
        before = snapshot(out)
        with pytest.raises(RunFolderLocked, match=rf"run folder {out} is in use by pid {proc.pid} on "):
            run(load_config(None, args + ["resume=true"]))
        capsys.readouterr()
        assert main(["train", *args, "overwrite=true"]) == 2
        assert f"is in use by pid {proc.pid}" in last_error(capsys)
        assert main(["export", str(out), str(tmp_path / "hf")]) == 2
        assert f"is in use by pid {proc.pid}" in last_error(capsys, "export")
        assert main(["export", str(list_checkpoints(out)[0][1]), str(tmp_path / "hf")]) == 2
        assert f"is in use by pid {proc.pid}" in last_error(capsys, "export")
        assert not (tmp_path / "hf").exists()
        assert snapshot(out) == before  # nothing touched
    finally:
        proc.kill()
        proc.wait()
    # the kernel dropped the lock with the process: the next run starts at once
    summary = run(load_config(None, args + ["resume=true"]))
    assert summary["start_step"] == 2 and summary["steps"] == 4


# -- 2. overwrite=true deletes nothing before everything has loaded ------------------------------

@pytest.mark.parametrize("bad", ["data", "model", "tokenizer"])
def test_overwrite_with_a_bad_input_keeps_the_old_run(bad, finished, rel_model_dir, rel_data, tmp_path, capsys):
    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"text": "fine"}\n{"text": oops\n')
    bad_model = tmp_path / "model"
    shutil.copytree(rel_model_dir, bad_model)
    (bad_model / "model.safetensors").write_bytes((bad_model / "model.safetensors").read_bytes()[:100])
    extra = {"data": [f"data={bad_data}"], "model": [f"model={bad_model}"],
             "tokenizer": [f"tokenizer={tmp_path / 'no-tokenizer'}"]}[bad]
    args = overrides(rel_model_dir, rel_data, out, "overwrite=true", *extra)
    assert main(["train", *args]) == 2
    last_error(capsys)
    assert snapshot(out) == before  # checkpoints, config.json, metrics.jsonl as they were
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6]


def test_overwrite_deletes_the_old_checkpoints_once_the_new_run_starts(finished, rel_model_dir, rel_data, tmp_path):
    out = copy_run(finished, tmp_path)
    run(load_config(None, overrides(rel_model_dir, rel_data, out, "overwrite=true", "max_steps=1")))
    assert [s for s, _ in list_checkpoints(out)] == [1]


# -- 3. export: never into a run or checkpoint folder, atomic, no silent overwrite ---------------

def test_export_refuses_a_target_in_a_run_or_checkpoint_folder(finished, tmp_path, capsys):
    out = copy_run(finished, tmp_path)
    ckpt = list_checkpoints(out)[-1][1]
    before = snapshot(out)
    for target, words in [
        (out, "is the run folder"),
        (out / "hf", "is inside the run folder"),
        (out / "checkpoints", "is inside the run folder"),
        (ckpt, "is the checkpoint folder"),
        (ckpt / "hf", "is inside the checkpoint folder"),
        (list_checkpoints(out)[0][1] / "export", "is inside the checkpoint folder"),
    ]:
        assert main(["export", str(out), str(target)]) == 2, target
        assert words in last_error(capsys, "export"), target
    assert snapshot(out) == before
    verify_checkpoint(ckpt)


def test_export_refuses_a_non_empty_target_unless_overwrite_and_is_atomic(finished, tmp_path, capsys, monkeypatch):
    import slidedp.train.export as export_mod

    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["export", str(finished), str(target)]) == 2
    assert "is not empty: pass --overwrite" in last_error(capsys, "export")
    assert (target / "notes.txt").read_text() == "mine"

    # an export that fails half-way (after the weights are written) leaves the target as it was
    real_copy = export_mod.shutil.copy2

    def failing_copy(src, dst):
        real_copy(src, dst)
        raise OSError("disk full (injected)")

    monkeypatch.setattr(export_mod.shutil, "copy2", failing_copy)
    with pytest.raises(OSError, match="injected"):
        export_checkpoint(finished, target, overwrite=True)
    with pytest.raises(OSError, match="injected"):
        export_checkpoint(finished, tmp_path / "fresh")
    monkeypatch.undo()
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left

    assert main(["export", "--overwrite", str(finished), str(target)]) == 0
    assert (target / "model.safetensors").is_file() and not (target / "notes.txt").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(finished), str(empty)]) == 0  # an empty folder needs no --overwrite
    assert (empty / "config.json").is_file()


def test_resume_and_export_fall_back_to_the_newest_checkpoint_that_verifies(
        finished, rel_model_dir, rel_data, tmp_path, capsys):
    out = copy_run(finished, tmp_path)
    six = list_checkpoints(out)[-1][1]
    (six / "state" / "layer-00001.safetensors").write_bytes(b"broken")
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint step-00000006 (step 6): checkpoint" in captured.err
    assert "state/layer-00001.safetensors has 6 bytes" in captured.err
    assert "(step 4," in captured.out
    summary = run(load_config(None, overrides(rel_model_dir, rel_data, out, "resume=true", "max_steps=5")))
    assert summary["start_step"] == 4 and summary["steps"] == 1
    err = capsys.readouterr().err
    assert "skipping checkpoint step-00000006 (step 6)" in err and "resuming from step-00000004 (step 4)" in err
    for _, folder in list_checkpoints(out):  # none left that verifies: refused, listing each
        (folder / "engine.json").write_text("{}")
    assert main(["train", *overrides(rel_model_dir, rel_data, out, "resume=true", "max_steps=7")]) == 2
    line = last_error(capsys)
    assert "no checkpoint of" in line and "step-00000002:" in line and "step-00000005:" in line


# -- 4. resume with changed keys ----------------------------------------------------------------

@pytest.mark.parametrize("change, key", [("seq_len=16", "seq_len"), ("seed=7", "seed"),
                                         ("packing=false", "packing"), ("val_fraction=0.2", "val_fraction")])
def test_resume_refuses_a_change_that_moves_the_data(change, key, finished, rel_model_dir, rel_data, tmp_path,
                                                     capsys):
    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    assert main(["train", *overrides(rel_model_dir, rel_data, out, "resume=true", "max_steps=8", change)]) == 2
    line = last_error(capsys)
    assert f"config key {key!r} is" in line and "cannot be resumed with another" in line, line
    assert snapshot(out) == before


def test_resume_with_a_new_batch_shape_and_lr_continues_at_the_same_row(finished, rel_model_dir, rel_data, tmp_path,
                                                                        capsys):
    out = copy_run(finished, tmp_path)
    capsys.readouterr()
    summary = run(load_config(None, overrides(rel_model_dir, rel_data, out, "resume=true", "max_steps=7",
                                              "batch_size=4", "grad_accum=2", "lr=1e-3")))
    assert summary["start_step"] == 6 and summary["steps"] == 1
    err = capsys.readouterr().err
    assert "batch_size changed on resume: 2 -> 4 (rows a step 2 -> 8)" in err
    assert "grad_accum changed on resume: 1 -> 2" in err
    assert "lr changed on resume: 0.005 -> 0.001" in err
    data = json.loads((list_checkpoints(out)[-1][1] / "trainer_state.json").read_text())["data"]
    assert data["epoch"] * data["num_rows"] + data["position"] == 6 * 2 + 8  # rows consumed, not steps
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 7 and record["lr"] == 1e-3


# -- 5. the RNG state continues exactly across processes ----------------------------------------

def test_rng_state_after_resume_equals_the_uninterrupted_runs(rel_model_dir, rel_data, tmp_path):
    """Each run as in a fresh process: the global generators start from unrelated states (NumPy's
    is seeded from the OS at import)."""
    def fresh_process(n):
        np.random.seed(1000 + n)
        random.seed(1000 + n)
        torch.manual_seed(1000 + n)

    a, b = tmp_path / "a", tmp_path / "b"
    fresh_process(1)
    run(load_config(None, overrides(rel_model_dir, rel_data, a, "max_steps=4")))
    fresh_process(2)
    run(load_config(None, overrides(rel_model_dir, rel_data, b, "max_steps=2")))
    fresh_process(3)
    run(load_config(None, overrides(rel_model_dir, rel_data, b, "max_steps=4", "resume=true")))
    ca, cb = list_checkpoints(a)[-1][1], list_checkpoints(b)[-1][1]
    ta, tb = read_safetensors(ca / "rng.safetensors"), read_safetensors(cb / "rng.safetensors")
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    ja, jb = json.loads((ca / "rng.json").read_text()), json.loads((cb / "rng.json").read_text())
    assert ja["python"] == jb["python"]
    assert ja["numpy"] == jb["numpy"]
    fa = json.loads((ca / "manifest.json").read_text())["files"]
    fb = json.loads((cb / "manifest.json").read_text())["files"]
    for name in fa:
        if name.startswith("state/") or name.startswith("rng."):
            assert fa[name]["sha256"] == fb[name]["sha256"], name


# -- 6. altered metadata: refused naming the file and the key -----------------------------------

@pytest.mark.parametrize("rel, change, words", [
    ("trainer_state.json", lambda d: d.update(tokens_seen="many"), "trainer_state.json key 'tokens_seen' must be"),
    ("trainer_state.json", lambda d: d.update(consecutive_skips=-2), "trainer_state.json key 'consecutive_skips'"),
    ("trainer_state.json", lambda d: d["data"].update(epoch=-1), "trainer_state.json key 'data.epoch' must be"),
    ("trainer_state.json", lambda d: d["data"].update(position=-3), "trainer_state.json key 'data.position' must"),
    ("trainer_state.json", lambda d: d["data"].update(position="3"), "trainer_state.json key 'data.position' must"),
    ("trainer_state.json", lambda d: d["data"].pop("num_rows"), "trainer_state.json key 'data.num_rows' must be"),
    ("trainer_state.json", lambda d: d.update(config={"lr": "fast"}), "trainer_state.json key 'config' is not"),
    ("engine.json", lambda d: d.update(skipped_steps="x"), "engine.json key 'skipped_steps' must be"),
    ("rng.json", lambda d: d["numpy"].update(pos="x"), "rng.json key 'numpy.pos' must be"),
    ("rng.json", lambda d: d["python"].update(state=[1, 2]), "rng.json key 'python.state' must be"),
])
def test_altered_metadata_is_refused_naming_the_file_and_key(rel, change, words, finished, rel_model_dir, rel_data,
                                                             tmp_path, capsys):
    out = copy_run(finished, tmp_path, keep={6})
    ck = list_checkpoints(out)[-1][1]
    data = json.loads((ck / rel).read_text())
    change(data)
    (ck / rel).write_text(json.dumps(data))
    reseal(ck, rel)
    assert main(["train", *overrides(rel_model_dir, rel_data, out, "max_steps=8", "resume=true")]) == 2
    line = last_error(capsys)
    assert words in line and str(ck) in line, line
    with pytest.raises(CheckpointError, match=words):
        from slidedp.train.job import _check_resume_candidate
        _check_resume_candidate(ck)
