"""Injected inf/nan gradients: the step is skipped, counted and logged, and the state (master weights,
both AdamW moments, the AdamW step counter) is bitwise unchanged; repeated skips abort the job.

Faults are injected through the model's own modules (a forward hook on a block), the way any
overflow would arise: in the forward (the loss and every gradient become nan) or only in the
backward (finite loss, infinite gradient).
"""

import json
import logging

import pytest
import torch

import slidedp
from slidedp.cli import main
from slidedp.errors import NonFiniteGradientError
from slidedp.train import job
from slidedp.train.config import load_config
from slidedp.train.job import run
from tests.models import VOCAB, make_model
from tests.reliability.conftest import overrides

SEQ, BATCH = 16, 2


class InfGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it becomes +inf."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


def poison(model, where: str, switch: dict):
    """While switch["on"], block 1's output is nan (forward) or its gradient inf (backward)."""
    def hook(module, args, output):
        if not switch["on"]:
            return None
        out = output[0] if isinstance(output, tuple) else output
        bad = out * float("nan") if where == "forward" else InfGrad.apply(out)
        return (bad, *output[1:]) if isinstance(output, tuple) else bad

    return model.model.layers[1].register_forward_hook(hook)


def snapshot(engine):
    engine.updates.flush()
    arrays = [t.clone() for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]
    return arrays, engine.host.step


def engine_for(model):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           optimizer=slidedp.AdamW(lr=1e-2, weight_decay=0.1), max_grad_norm=1.0)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_non_finite_step_is_skipped_counted_logged_and_changes_nothing(where, caplog):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(4)]
    switch = {"on": False}
    model = make_model("llama")
    poison(model, where, switch)
    engine = engine_for(model)
    clean = engine_for(make_model("llama"))  # the same run without the bad step
    for ids in batches[:2]:
        engine.step(ids)
        clean.step(ids)
    before, step_before = snapshot(engine)
    assert step_before == 2

    switch["on"] = True
    with caplog.at_level(logging.WARNING, logger="slidedp"):
        loss = engine.step(batches[2])
    switch["on"] = False
    info = engine.last_step
    assert info.skipped and engine.skipped_steps == 1
    assert not torch.isfinite(torch.tensor(info.grad_norm))
    if where == "backward":
        assert torch.isfinite(torch.tensor(loss))  # the loss was fine, only the gradient was not
    assert any("step skipped: non-finite gradient" in r.getMessage() for r in caplog.records)
    after, step_after = snapshot(engine)
    assert step_after == step_before  # the AdamW step counter did not move (bias correction unchanged)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # master, exp_avg, exp_avg_sq: same bits

    engine.step(batches[3])  # the run continues as if the bad step had never happened
    clean.step(batches[3])
    assert engine.host.step == clean.host.step == 3
    ours, theirs = engine.state_dict(), clean.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(torch.equal(x, y) for x, y in zip(snapshot(engine)[0], snapshot(clean)[0]))
    engine.close()
    clean.close()


def poisoned_job(monkeypatch, bad_steps):
    """The train job's model gets the backward fault on the optimizer steps in `bad_steps` (1-based)."""
    switch = {"on": False}
    original = job.load_model_and_tokenizer

    def load(cfg):
        model, tok = original(cfg)
        poison(model, "backward", switch)
        return model, tok

    monkeypatch.setattr(job, "load_model_and_tokenizer", load)
    original_step = slidedp.run.engine.Engine.step
    calls = {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        switch["on"] = calls["n"] in bad_steps
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(slidedp.run.engine.Engine, "step", step)


def test_job_logs_a_skip_and_goes_on(monkeypatch, rel_model_dir, rel_data, tmp_path, capsys):
    out = tmp_path / "run"
    poisoned_job(monkeypatch, {2, 3})
    summary = run(load_config(None, overrides(rel_model_dir, rel_data, out, "max_skipped_steps=3")))
    assert summary["steps"] == 6
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True, False, False, False]
    assert records[-1]["skipped_steps"] == 2
    err = capsys.readouterr().err
    assert "step 2 skipped: non-finite gradient" in err and "(2 in a row, 2 in all)" in err
    engine_json = json.loads((job.list_checkpoints(out)[-1][1] / "engine.json").read_text())
    assert engine_json["step"] == 4 and engine_json["skipped_steps"] == 2  # 6 steps, 2 skipped


def test_repeated_skips_abort_the_job_with_a_clear_message(monkeypatch, rel_model_dir, rel_data, tmp_path):
    out = tmp_path / "run"
    poisoned_job(monkeypatch, {3, 4, 5, 6})
    with pytest.raises(NonFiniteGradientError, match=r"3 consecutive steps \(up to step 5\) had a non-finite "
                                                     r"gradient.*max_skipped_steps=3.*weights are those of step 2"):
        run(load_config(None, overrides(rel_model_dir, rel_data, out, "max_skipped_steps=3")))
    assert [s for s, _ in job.list_checkpoints(out)] == [2, 4]  # step 4's checkpoint = step 2's state
    engine_json = json.loads((job.list_checkpoints(out)[-1][1] / "engine.json").read_text())
    assert engine_json["step"] == 2 and engine_json["skipped_steps"] == 2  # steps 3 and 4 skipped


def test_cli_reports_the_abort_in_one_line(monkeypatch, rel_model_dir, rel_data, tmp_path, capsys):
    poisoned_job(monkeypatch, set(range(1, 10)))
    code = main(["train", *overrides(rel_model_dir, rel_data, tmp_path / "run", "max_skipped_steps=2")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("slidedp train: error: 2 consecutive steps (up to step 2)")
