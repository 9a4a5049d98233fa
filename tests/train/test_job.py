"""`slidedp train` on a user's model and data: schedule, validation, checkpoints, exact resume, export.

Every run here is a 2-block Llama with a ~300-token tokenizer (tests/train/conftest.py), on CPU in
fp32, a few steps long.
"""

import json
import shutil

import pytest
import torch

from slidedp.run.checkpoint import CheckpointError, read_master_weights
from slidedp.cli import main
from slidedp.train.config import load_config
from slidedp.train.job import list_checkpoints, run

STEPS = 4


def config(tiny_model_dir, data, out, *overrides):
    return load_config(None, [
        f"model={tiny_model_dir}", f"data={data}", f"output_dir={out}", f"max_steps={STEPS}", "batch_size=2",
        "grad_accum=2", "seq_len=32", "lr=5e-3", "warmup_steps=3", "weight_decay=0.1", "max_grad_norm=1.0",
        "val_fraction=0.25", "val_every=1", "save_every=2", "keep_last=3", "precision=fp32", "device=cpu",
        "progress=false", *overrides,
    ])


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_a(tiny_model_dir, tiny_jsonl, tmp_path_factory):
    """4 steps in one go on prompt/completion data: checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("run-a")
    summary = run(config(tiny_model_dir, tiny_jsonl[0], out))
    return out, summary


def test_resume_is_bitwise(run_a, tiny_model_dir, tiny_jsonl, tmp_path):
    """2 steps, then resume to 4 == 4 steps in one go: the same bits in weights, moments, losses."""
    a, summary_a = run_a
    b = tmp_path / "b"
    first = run(config(tiny_model_dir, tiny_jsonl[0], b, "max_steps=2", "keep_last=1"))
    assert first["steps"] == 2 and [c for c, _ in list_checkpoints(b)] == [2]
    second = run(config(tiny_model_dir, tiny_jsonl[0], b, "resume=true", "keep_last=1"))
    assert second["start_step"] == 2 and second["steps"] == 2
    assert first["losses"] + second["losses"] == summary_a["losses"]
    assert [c for c, _ in list_checkpoints(b)] == [4]  # keep_last=1

    ckpt_a, ckpt_b = list_checkpoints(a)[-1][1], list_checkpoints(b)[-1][1]
    wa, wb = read_master_weights(ckpt_a), read_master_weights(ckpt_b)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    files_a = json.loads((ckpt_a / "manifest.json").read_text())["files"]
    files_b = json.loads((ckpt_b / "manifest.json").read_text())["files"]
    for name in files_a:
        if name.startswith("state/"):  # master weights and both AdamW moments, bit for bit
            assert files_a[name]["sha256"] == files_b[name]["sha256"], name
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [1, 2, 3, 4]  # the resumed run continued the metrics file
    for ra, rb in zip(ma, mb):
        for key in ("loss", "grad_norm", "lr", "val_loss", "epoch", "trained_tokens"):
            assert ra[key] == rb[key], (ra["step"], key)
    state_a = json.loads((ckpt_a / "trainer_state.json").read_text())
    state_b = json.loads((ckpt_b / "trainer_state.json").read_text())
    assert state_a["data"] == state_b["data"] and state_a["schedule"] == state_b["schedule"]


def test_run_writes_config_metrics_and_checkpoints(run_a, tiny_model_dir, tiny_jsonl):
    out, summary = run_a
    written = json.loads((out / "config.json").read_text())
    assert written["data"]["val_every"] == 1  # in sections
    # read back, with the world size resolved (0: torchrun's, else 1)
    assert load_config(str(out / "config.json"), []) == config(tiny_model_dir, tiny_jsonl[0], out, "world_size=1")
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([5e-3 / 3, 2 * 5e-3 / 3, 5e-3, 5e-3])  # warm-up
    for r in records:
        for key in ("loss", "grad_norm", "tokens_per_s", "tflops", "step_s", "preset_estimate_step_s",
                    "host_rss_bytes", "val_loss"):
            assert r[key] > 0, key
        assert "predicted_step_s" not in r  # the "cpu" preset's figure is no prediction for this machine
        assert r["mfu"] is None and r["device_bytes"] is None  # no GPU: no known peak, no device memory
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["val_loss"] < records[0]["val_loss"]
    assert summary["val_loss"] == records[-1]["val_loss"]
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]
    last = list_checkpoints(out)[-1][1]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["schedule"]["current_lr"] == 5e-3 and state["data"]["position"] >= 0
    for name in ("hf/config.json", "hf/tokenizer.json", "hf/tokenizer_config.json", "plan.json", "engine.json"):
        assert (last / name).is_file(), name
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_train_prints_a_short_plan_and_keeps_the_whole_one(tiny_model_dir, tiny_jsonl, tmp_path, capsys,
                                                          monkeypatch):
    """Before the first step: 3 lines (where things run, the step and peak memory, where the whole
    plan is), the CPU preset named once as a guess and never as a per-step prediction; --verbose
    prints the whole summary; the run folder keeps plan.json, which `inspect` reads."""
    from slidedp import logs
    from slidedp.scheduler.plan import Plan

    monkeypatch.setattr(logs, "_warned", set())
    out = tmp_path / "short"
    common = [f"model={tiny_model_dir}", f"data={tiny_jsonl[0]}", "max_steps=1", "batch_size=2", "seq_len=32",
              "val_fraction=0", "precision=fp32", "device=cpu", "progress=false", "tensorboard=false"]
    assert main(["train", *common, f"output_dir={out}"]) == 0
    err = capsys.readouterr().err
    brief = [line for line in err.splitlines() if line.startswith("[slidedp] schedule: ")]
    assert len(brief) == 1 and "blocks streamed through a window of" in brief[0], err
    assert f"slidedp inspect {out / 'plan.json'}" in err and "peak device memory" in err
    assert "why these decisions" not in err and "device memory at the peak" not in err  # not the solver dump
    assert err.count("'cpu' preset") == 1 and "an estimate" in err  # said once, as a guess
    step_lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert step_lines and not any("predicted" in line for line in step_lines)
    assert Plan.load(out / "plan.json").predicted_step_time_s > 0
    assert main(["inspect", str(out / "plan.json")]) == 0 and "why these decisions" in capsys.readouterr().out

    assert main(["train", *common, f"output_dir={tmp_path / 'verbose'}", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "why these decisions" in err and "[slidedp] schedule: " in err


def test_export_from_checkpoint_loads_and_generates(run_a, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run_a
    assert main(["export", str(out), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0  # a run folder: its latest
    assert "step 4" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    weights = read_master_weights(list_checkpoints(out)[-1][1])
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert main(["export", str(out), str(tmp_path / "bf16")]) == 0  # default: bf16, as trained to run
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    for name, p in half.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name].bfloat16()), name
    assert all((f.stat().st_mode & 0o044) == 0o044 for f in (tmp_path / "bf16").iterdir())  # readable by others
    prompt = tok("Question 3: what is", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt.input_ids.shape[1] + 5
    assert isinstance(tok.decode(generated[0]), str)
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "x")]) == 2  # not a checkpoint
    assert "neither a slidedp checkpoint" in capsys.readouterr().err


def test_padding_loss_is_the_models_masked_loss(tiny_model_dir, tiny_jsonl, tmp_path):
    """packing=false: attention masks and -100 labels reach the engine; step 1's loss is the HF loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slidedp.train.job import load_data

    cfg = config(tiny_model_dir, tiny_jsonl[0], tmp_path / "pad", "packing=false", "max_steps=1",
                 "val_fraction=0")
    summary = run(cfg)
    batch = load_data(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)).next_fields(4)
    assert bool((batch.attention_mask == 0).any()) and bool((batch.labels == -100).any())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
    assert summary["losses"][0] == pytest.approx(expected.item(), rel=1e-5)


def test_preset_model_with_random_init(tiny_model_dir, tiny_jsonl, tmp_path):
    out = tmp_path / "preset"
    stale = out / "checkpoints" / "step-00000009"
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")
    cfg = config(tiny_model_dir, tiny_jsonl[1], out, "model=llama-tiny", f"tokenizer={tiny_model_dir}",
                 "max_steps=2", "save_every=0", "val_fraction=0", "lr_schedule=cosine", "warmup_steps=0")
    with pytest.raises(ValueError, match="already holds checkpoints .*resume=true.*overwrite=true"):
        run(cfg)
    dotted = [f"{section}.{k}={v}" for section, keys in cfg.to_dict().items() for k, v in keys.items()]
    summary = run(load_config(None, dotted + ["checkpoint.overwrite=true"]))
    assert summary["first_loss"] == pytest.approx(torch.log(torch.tensor(49152.0)).item(), rel=0.05)  # random init
    assert [s for s, _ in list_checkpoints(out)] == [2]
    hf = json.loads((list_checkpoints(out)[-1][1] / "hf" / "config.json").read_text())
    assert hf["vocab_size"] == 49152 and hf["hidden_size"] == 64


def test_resume_refuses_a_damaged_checkpoint(run_a, tiny_model_dir, tiny_jsonl, tmp_path, capsys):
    """The newest checkpoint that verifies is used, each newer one named on stderr; none: refused."""
    a, _ = run_a
    out = tmp_path / "damaged"
    shutil.copytree(a, out)
    for _, folder in list_checkpoints(out):
        layer = folder / "state" / "layer-00001.safetensors"
        layer.write_bytes(layer.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="state/layer-00001.safetensors has 100 bytes"):
        run(config(tiny_model_dir, tiny_jsonl[0], out, "resume=true", "max_steps=6"))
    shutil.rmtree(out)
    shutil.copytree(a, out)
    layer = list_checkpoints(out)[-1][1] / "state" / "layer-00001.safetensors"
    layer.write_bytes(layer.read_bytes()[:100])
    capsys.readouterr()
    summary = run(config(tiny_model_dir, tiny_jsonl[0], out, "resume=true", "max_steps=5"))
    assert summary["start_step"] == 2
    err = capsys.readouterr().err
    assert "skipping checkpoint step-00000004 (step 4): checkpoint" in err
    assert "state/layer-00001.safetensors has 100 bytes" in err and "resuming from step-00000002" in err


def test_resume_at_max_steps_does_nothing(run_a, tiny_model_dir, tiny_jsonl, tmp_path, capsys):
    out = tmp_path / "done"
    shutil.copytree(run_a[0], out)
    summary = run(config(tiny_model_dir, tiny_jsonl[0], out, "resume=true"))
    assert summary["steps"] == 0 and summary["start_step"] == STEPS
    assert "nothing to do" in capsys.readouterr().err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


def test_resume_reuses_the_plan_of_a_sectioned_or_old_flat_checkpoint_config(run_a, tiny_model_dir, tiny_jsonl):
    """trainer_state.json's config is compared on resume: sectioned now, flat in checkpoints of earlier versions."""
    from slidedp.train.job import _reusable_plan

    out, _ = run_a
    ckpt = list_checkpoints(out)[-1][1]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert set(state["config"]) >= {"model", "optimizer", "training"}
    flat = {k: v for section in state["config"].values() for k, v in section.items()}
    cfg, cpu = config(tiny_model_dir, tiny_jsonl[0], out, "max_steps=6", "resume=true"), torch.device("cpu")
    for old in (state["config"], flat):
        assert _reusable_plan(ckpt, dict(state, config=old), cfg, cpu, "fp32") == ckpt / "plan.json"
        for key in ("batch_size=1", "group_rows=true"):
            changed = config(tiny_model_dir, tiny_jsonl[0], out, key)
            assert _reusable_plan(ckpt, dict(state, config=old), changed, cpu, "fp32") is None, key
    assert _reusable_plan(ckpt, dict(state, config={"lr": "fast"}), cfg, cpu, "fp32") is None


def test_resume_from_a_chosen_checkpoint(run_a, tiny_model_dir, tiny_jsonl, tmp_path, capsys):
    """resume=PATH continues from that checkpoint (not the latest), verified like the latest; a folder
    that is not a checkpoint is refused naming it."""
    a, summary_a = run_a
    step2 = dict(list_checkpoints(a))[2]
    b = tmp_path / "b"
    resumed = run(config(tiny_model_dir, tiny_jsonl[0], b, f"resume={step2}"))
    assert resumed["start_step"] == 2 and resumed["losses"] == summary_a["losses"][2:]
    wa, wb = read_master_weights(list_checkpoints(a)[-1][1]), read_master_weights(list_checkpoints(b)[-1][1])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    assert main(["train", *[f"{k}={v}" for k, v in (("model", tiny_model_dir), ("data", tiny_jsonl[0]),
                                                   ("output_dir", tmp_path / "c"), ("resume", tiny_model_dir),
                                                   ("seq_len", 32), ("device", "cpu"))]]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"config key 'resume': {tiny_model_dir} is not a slidedp checkpoint folder" in err

    broken = tmp_path / "broken"
    shutil.copytree(step2, broken)
    (broken / "engine.json").write_text("{}")
    with pytest.raises(CheckpointError, match="engine.json"):
        run(config(tiny_model_dir, tiny_jsonl[0], tmp_path / "d", f"resume={broken}"))


def test_group_rows_lets_the_plan_group_a_steps_rows(tiny_model_dir, tiny_jsonl, tmp_path):
    """group_rows=true: the plan in the run folder was chosen among the groupings of the step's rows
    (batch_size x grad_accum), and holds one of them."""
    from slidedp.scheduler.plan import Plan

    out = tmp_path / "grouped"
    summary = run(config(tiny_model_dir, tiny_jsonl[0], out, "max_steps=1", "batch_size=1", "grad_accum=4",
                         "group_rows=true", "save_every=0"))
    assert summary["steps"] == 1
    plan = Plan.load(out / "plan.json")
    assert set(plan.solver["rows_tried"]) == {"1", "2", "4"}
    assert plan.workload.batch_size * plan.workload.micro_batches == 4
