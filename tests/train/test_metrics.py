"""Live metrics: the JSONL file, the per-step line, the progress bar and TensorBoard when installed."""

import json

import pytest

from slidedp.train import metrics
from slidedp.train.metrics import MetricsLogger, format_line, host_rss_bytes, model_flops_per_step

RECORD = {"step": 3, "loss": 2.5, "grad_norm": 0.75, "lr": 1e-4, "tokens_per_s": 1234.0, "tflops": 0.5,
          "mfu": 0.25, "device_bytes": 3 * 2**30, "host_rss_bytes": 2**30, "step_s": 0.4, "predicted_step_s": 0.3,
          "skipped": False}


def test_per_step_line_has_every_figure():
    line = format_line({**RECORD, "val_loss": 2.75}, 10, eta_s=125)
    for words in ("step     3/10", "loss 2.5000", "val 2.7500", "grad norm 0.750", "lr 1.00e-04", "1234 tok/s",
                  "0.5 TFLOP/s", "MFU 25.0%", "dev 3.00 GiB", "host 1.00 GiB", "step 0.40s (predicted 0.30s)",
                  "eta 2:05"):
        assert words in line, words
    assert "MFU" not in format_line({**RECORD, "mfu": None}, 10, None)
    # a preset's guess for this machine is no prediction: kept under its own name, off the line
    guess = {k: v for k, v in RECORD.items() if k != "predicted_step_s"} | {"preset_estimate_step_s": 0.3}
    assert "step 0.40s" in format_line(guess, 10, None) and "predicted" not in format_line(guess, 10, None)


def test_missing_tensorboard_is_said_once(tmp_path, monkeypatch, caplog):
    from slidedp import logs

    monkeypatch.setattr(logs, "_warned", set())
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda log_dir: None)
    for _ in range(2):
        MetricsLogger(tmp_path, max_steps=1, start_step=0, log_every=1, progress=False, tensorboard=True).close()
    MetricsLogger(tmp_path, max_steps=1, start_step=0, log_every=1, progress=False, tensorboard=False).close()
    said = [r.getMessage() for r in caplog.records if "TensorBoard is not installed" in r.getMessage()]
    assert len(said) == 1 and "tensorboard=false" in said[0]


class FakeWriter:
    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


class FakeBar:
    disable = False

    def __init__(self, **kwargs):
        self.kwargs, self.n, self.lines, self.closed = kwargs, kwargs["initial"], [], False

    def update(self, n):
        self.n += n

    def set_postfix(self, **kwargs):
        self.postfix = kwargs

    def write(self, line, file=None):
        self.lines.append(line)

    def close(self):
        self.closed = True


def test_logger_uses_tqdm_and_tensorboard_and_truncates_on_resume(tmp_path, monkeypatch):
    writer = FakeWriter()
    bars = []
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda log_dir: writer)
    monkeypatch.setattr(metrics, "_tqdm", lambda **kw: bars.append(FakeBar(**kw)) or bars[-1])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    log = MetricsLogger(tmp_path, max_steps=10, start_step=2, log_every=1, progress=True, tensorboard=True)
    log.log(RECORD)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert ("train/loss", 2.5, 3) in writer.scalars and writer.closed
    bar = bars[0]
    assert bar.kwargs["total"] == 10 and bar.n == 3 and bar.closed
    assert bar.lines and bar.lines[0].startswith("step     3/10")


def test_logger_without_bar_prints_lines_with_eta(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda log_dir: pytest.fail("tensorboard=false"))
    log = MetricsLogger(tmp_path, max_steps=10, start_step=2, log_every=2, progress=False, tensorboard=False)
    log.log(RECORD)  # step 3: not a multiple of log_every
    log.log({**RECORD, "step": 4})
    log.close()
    err = capsys.readouterr().err
    assert "step     3/10" not in err and "step     4/10" in err and "eta" in err


def test_flops_and_memory():
    from types import SimpleNamespace

    from slidedp.ir.graph import LayerCosts

    graph = SimpleNamespace(layers=[SimpleNamespace(costs=LayerCosts(flops_fwd=f, flops_bwd=2 * f)) for f in (0, 5, 7)])
    assert model_flops_per_step(graph, 1) == 36 and model_flops_per_step(graph, 3) == 108
    assert host_rss_bytes() > 10 * 2**20
