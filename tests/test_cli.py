"""The command line and the train configuration."""

import json

import pytest

from slidedp.cli import main
from slidedp.train.config import TrainConfig, load_config


def test_config_defaults_files_and_overrides(tmp_path):
    assert load_config(None, []) == TrainConfig()
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 7\nlr: 0.001\nmodel: some/folder\n")
    cfg = load_config(str(path), ["max_steps=9", "precision=fp32"])
    assert (cfg.training.max_steps, cfg.optimizer.lr, cfg.model.model, cfg.engine.precision) == (
        9, 0.001, "some/folder", "fp32")
    toml = tmp_path / "run.toml"
    toml.write_text('batch_size = 2\ndata = "corpus"\n')
    assert load_config(str(toml), []).training.batch_size == 2


@pytest.mark.parametrize("overrides, words", [
    (["max_stepz=3"], "unknown config key"),
    (["max_steps=three"], "'max_steps' must be an integer"),
    (["lr=fast"], "'lr' must be a number"),
    (["max_steps=0"], "'max_steps' must be >= 1"),
    (["precision=fp8"], "'precision'"),
    (["novalue"], "key=value"),
    (["lr_schedule=step"], "'lr_schedule' must be constant, constant_with_warmup, linear, cosine or inverse_sqrt"),
    (["val_fraction=1.5"], "'val_fraction' must be in"),
    (["packing=maybe"], "'packing' must be true or false"),
    (["keep_last=0"], "'keep_last' must be >= 1"),
    (["min_lr=1", "lr=0.1"], "'min_lr'"),
    (["save_every=-1"], "'save_every' must be >= 0"),
])
def test_bad_config_is_refused_naming_the_key(overrides, words):
    with pytest.raises((ValueError, TypeError), match=words):
        load_config(None, overrides)


def test_config_new_keys_and_data_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: [a.jsonl, folder]\nsave_every: 5\nresume: true\nlr_schedule: cosine\n"
                    "warmup_steps: 10\npacking: false\nval_fraction: 0.1\nval_every: 50\n")
    cfg = load_config(str(path), ["keep_last=3"])
    assert (cfg.data.data, cfg.checkpoint.save_every, cfg.checkpoint.resume, cfg.schedule.lr_schedule,
            cfg.schedule.warmup_steps, cfg.data.packing, cfg.data.val_fraction, cfg.data.val_every,
            cfg.checkpoint.keep_last) == ("a.jsonl,folder", 5, True, "cosine", 10, False, 0.1, 50, 3)


def test_cli_export_errors_without_traceback(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a slidedp checkpoint" in capsys.readouterr().err


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["train", "max_stepz=3"]) == 2
    assert "unknown config key" in capsys.readouterr().err


def test_cli_plan_and_inspect(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "qwen3-0.6b", "--budget", "20GiB", "--batch-size", "1", "--seq-len", "1024",
                 "--hardware", "h100-sxm", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["workload"]["seq_len"] == 1024
    # the placement of the optimizer state is a decision of the model, credited to the search that made it
    assert "optimizer state on the device" in plan["explanation"]["solver"]["searches"]
    assert out.stat().st_size < 200_000  # the timeline is kept as rows, not one object per event
    assert main(["inspect", str(out)]) == 0
    assert "predicted step" in capsys.readouterr().out
    # the same decisions under another profile: the cost model's step there, beside the plan's own
    assert main(["inspect", str(out), "--model", "qwen3-0.6b", "--hardware", "h100-sxm"]) == 0
    own = json.loads(out.read_text())["explanation"]["predicted"]["step_s"]
    assert f"under h100-sxm: {own * 1e3:.1f} ms a step" in capsys.readouterr().out
    assert main(["inspect", str(out), "--model", "qwen3-0.6b", "--hardware", "rtx4090"]) == 0
    slower = capsys.readouterr().out.split("under rtx4090: ")[1]
    assert float(slower.split(" ms")[0]) > own * 1e3
    assert main(["inspect", str(out), "--hardware", "h100-sxm"]) == 2
    assert "--hardware needs --model" in capsys.readouterr().err
    assert main(["plan", "no-such-model", "--budget", "1GiB", "--batch-size", "1", "--seq-len", "8"]) == 2
    assert main(["plan", "qwen3-0.6b", "--budget", "20GiB", "--batch-size", "1", "--seq-len", "1024",
                 "--hardware", "h100-sxm", "--host-memory", "lots", "--out", str(out)]) == 2
    assert "host_memory" in capsys.readouterr().err


def test_cli_report_writes_html_and_trace_and_needs_an_output(tmp_path, capsys):
    from slidedp.scheduler.plan import Plan

    out = tmp_path / "plan.json"
    assert main(["plan", "qwen3-0.6b", "--budget", "20GiB", "--batch-size", "1", "--seq-len", "1024",
                 "--hardware", "h100-sxm", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert "give --html OUT.html and/or --trace OUT.json" in capsys.readouterr().err
    html, trace = tmp_path / "r.html", tmp_path / "t.json"
    assert main(["report", str(out), "--html", str(html), "--trace", str(trace)]) == 0
    captured = capsys.readouterr()
    assert str(html) in captured.out and str(trace) in captured.out
    if not Plan.load(out).timeline:
        assert "no predicted timeline" in captured.err
    assert "<svg" in html.read_text() or "no predicted timeline" in html.read_text()
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["report", str(tmp_path / "missing.json"), "--html", str(html)]) == 2


@pytest.mark.parametrize("exc, code, words", [
    (KeyboardInterrupt(), 130, "slidedp inspect: interrupted"),
    (RuntimeError("kaputt\nsecond line"), 1, "slidedp inspect: internal error: RuntimeError: kaputt second line "
                                              "(run with SLIDEDP_DEBUG=1 for the traceback"),
    (KeyError("schema"), 2, "slidedp inspect: error: missing key 'schema'"),
    (PermissionError("denied: plan.json"), 2, "slidedp inspect: error: denied: plan.json"),
])
def test_cli_turns_every_error_into_one_line_and_a_status(exc, code, words, monkeypatch, capsys):
    from slidedp.scheduler.plan import Plan

    def boom(path):
        raise exc

    monkeypatch.setattr(Plan, "load", staticmethod(boom))
    monkeypatch.delenv("SLIDEDP_DEBUG", raising=False)
    assert main(["inspect", "plan.json"]) == code
    err = capsys.readouterr().err
    assert err.strip() == words or err.strip().startswith(words), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    monkeypatch.setenv("SLIDEDP_DEBUG", "1")  # the traceback, for a bug report
    with pytest.raises(type(exc)):
        main(["inspect", "plan.json"])


def test_cli_budget_and_skip_keys_in_config(tmp_path):
    assert load_config(None, []).training.max_skipped_steps == 10
    assert load_config(None, ["max_skipped_steps=0", "budget=512MiB"]).engine.budget == "512MiB"
    with pytest.raises(ValueError, match="config key 'budget': cannot parse budget"):
        load_config(None, ["budget=big"])


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_train_help_lists_every_config_key_with_its_default_and_meaning(capsys):
    from dataclasses import fields

    from slidedp.train.config import SECTIONS

    text = _help(capsys, "train")
    for section, typ in SECTIONS.items():
        for f in fields(typ):
            assert f.metadata.get("help"), f"config key {f.name!r} has no help"
            line = next((l for l in text.splitlines() if l.strip().startswith(f"{f.name} = ")), None)
            assert line is not None, f.name
            assert f.metadata["help"].split()[0] in line, line
    assert "budget = 16GiB:" in text and "resume = false:" in text


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_plan_and_bench_flags_have_help_and_list_the_presets(command, capsys):
    import argparse

    from slidedp.costmodel.hardware import PRESETS as HW
    from slidedp.train.shapes import PRESETS as SHAPES

    text = " ".join(_help(capsys, command).split())
    for name in [*SHAPES, *HW]:
        assert name in text, name
    captured = {}
    real = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        captured["parser"] = self
        return real(self, args, namespace)

    import unittest.mock
    with unittest.mock.patch.object(argparse.ArgumentParser, "parse_args", spy), pytest.raises(SystemExit):
        main([command, "--help"])
    sub = captured["parser"]._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"


def test_resume_is_true_false_or_a_folder():
    assert load_config(None, ["resume=yes"]).checkpoint.resume is True
    assert load_config(None, ["resume=runs/a/checkpoints/step-00000004"]).checkpoint.resume == \
        "runs/a/checkpoints/step-00000004"
    with pytest.raises(TypeError, match="'resume' must be true, false or a checkpoint folder"):
        TrainConfig.from_dict({"resume": 3})


def test_unknown_command_and_config_key_say_did_you_mean(capsys):
    assert main(["trian"]) == 2
    assert "did you mean 'train'?" in capsys.readouterr().err
    assert main(["train", "max_step=3"]) == 2
    err = capsys.readouterr().err
    assert "max_step (did you mean 'max_steps'?)" in err and len(err.strip().splitlines()) == 1


def test_inspect_of_a_file_that_is_not_a_plan_says_so_in_one_line(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"lr": 1e-4, "max_steps": 3}))
    for path, words in ((config, "is not a slidedp plan"), (tmp_path, "is a folder, not a plan file")):
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err


def test_a_hub_id_as_model_says_to_download_it_first(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "Qwen/Qwen3-4B", "--budget", "24GiB", "--batch-size", "1", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert "Qwen/Qwen3-4B looks like a Hugging Face Hub id" in err and "download" in err
    assert main(["train", "model=Qwen/Qwen3-4B", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "config key 'model': Qwen/Qwen3-4B looks like a Hugging Face Hub id" in err


def test_precision_auto_in_the_api_as_in_the_cli():
    import torch
    from transformers import AutoModelForCausalLM

    import slidedp
    from slidedp.train.shapes import preset_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("llama-tiny"))
    assert slidedp.plan(model, "8GiB", batch_size=1, seq_len=16, hardware="h100-sxm").workload.precision == "bf16"
    cpu = slidedp.plan(model, "8GiB", batch_size=1, seq_len=16, hardware="cpu")
    assert cpu.workload.precision == "fp32"
    assert slidedp.CompileOptions(batch_size=1, seq_len=16).precision == "auto"
    engine = slidedp.compile(AutoModelForCausalLM.from_config(preset_config("llama-tiny")), "1GiB", batch_size=1,
                             seq_len=16, device="cpu")
    assert engine.precision == "fp32"  # fp32 on the CPU
    engine.close()


def test_cli_plan_streams_gradients_at_the_least_host_memory_with_nonfinite_stop(tmp_path, capsys):
    """--nonfinite stop without --max-grad-norm: at the least host RAM that plans, every gradient streams
    into its update; with clipping the least host RAM that plans is more (the gradients are kept)."""
    import re

    base = ["plan", "llama-tiny", "--budget", "8GiB", "--batch-size", "1", "--seq-len", "64", "--hardware", "h200-sxm",
            "--out", str(tmp_path / "plan.json")]

    def least(*flags) -> int:
        assert main([*base, "--host-memory", "1B", *flags]) == 2
        return int(re.search(r"give host_memory at least (\d+) bytes", capsys.readouterr().err).group(1))

    stop, clipped = least("--nonfinite", "stop"), least("--nonfinite", "stop", "--max-grad-norm", "1.0")
    assert stop < clipped
    assert main([*base, "--host-memory", f"{stop}B", "--nonfinite", "stop"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schedule"]["streamed_gradients"] and "streamed gradients" in capsys.readouterr().out


def test_cli_plan_takes_none_for_no_clipping(tmp_path, capsys):
    """--max-grad-norm none is the default said out loud; a bad value is refused with the choices."""
    base = ["plan", "llama-tiny", "--budget", "8GiB", "--batch-size", "1", "--seq-len", "64", "--hardware", "h200-sxm"]
    assert main([*base, "--max-grad-norm", "none", "--out", str(tmp_path / "none.json")]) == 0
    assert main([*base, "--out", str(tmp_path / "default.json")]) == 0
    none, default = (json.loads((tmp_path / f).read_text()) for f in ("none.json", "default.json"))
    assert none["schedule"] == default["schedule"]
    capsys.readouterr()
    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(SystemExit):
            main([*base, "--max-grad-norm", bad])
        assert "positive number or 'none'" in capsys.readouterr().err


def test_cli_plan_groups_rows_when_asked(tmp_path, capsys):
    """--group-rows: the plan holds a grouping of the same rows a step, and says a sweep chose it."""
    base = ["plan", "llama-tiny", "--budget", "8GiB", "--batch-size", "1", "--micro-batches", "4", "--seq-len", "64",
            "--hardware", "h200-sxm", "--out", str(tmp_path / "plan.json")]
    assert main([*base, "--group-rows"]) == 0
    workload = json.loads((tmp_path / "plan.json").read_text())["workload"]
    assert workload["batch_size"] * workload["micro_batches"] == 4
    assert "decided by: rows per micro-batch: sweep" in capsys.readouterr().out
    assert main(base) == 0
    assert "rows per micro-batch" not in capsys.readouterr().out
