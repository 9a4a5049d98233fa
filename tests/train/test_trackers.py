"""report_to: the run's scalars also go to W&B (offline) and MLflow (local file store), each only
when installed; a tracker named but missing is refused when the config is read."""

import importlib.machinery
import sys
import types

import pytest

from slidedp.train.config import TrainConfig
from slidedp.train.metrics import MetricsLogger
from slidedp.train.trackers import flat_keys, open_trackers, parse_report_to, tracking_uri


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_gets_every_step_offline_in_the_run_folder(fake_wandb, tmp_path):
    config = flat_keys(TrainConfig.from_dict({"report_to": "wandb"}).to_dict())
    assert config["metrics.report_to"] == "wandb" and "optimizer.lr" in config
    trackers = open_trackers(parse_report_to("wandb"), tmp_path, config, resumed=False)
    logger = MetricsLogger(tmp_path, max_steps=2, start_step=0, log_every=1, progress=False, tensorboard=False,
                           trackers=trackers)
    for step in (1, 2):
        logger.log({"step": step, "loss": 3.0 / step, "val_loss": None, "grad_norm": 1.0, "lr": 1e-5,
                    "tokens_per_s": 10.0, "tflops": 0.1, "step_s": 0.5})
    logger.close()
    (kind, init), *rest = fake_wandb
    assert kind == "init" and init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["config"] == config
    logged = [c for c in rest if c[0] == "log"]
    assert [c[2] for c in logged] == [1, 2] and logged[1][1]["train/loss"] == 1.5
    assert "train/val_loss" not in logged[0][1]  # not measured that step: not sent
    assert rest[-1] == ("finish",)


def test_a_missing_or_unknown_tracker_is_refused_when_the_config_is_read(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import (and find_spec) of mlflow fails
    with pytest.raises(ValueError, match="names mlflow, which is not installed: `pip install mlflow`"):
        TrainConfig.from_dict({"report_to": "mlflow"})
    with pytest.raises(ValueError, match="unknown tracker 'tensorbord'"):
        TrainConfig.from_dict({"report_to": "tensorbord"})
    assert TrainConfig.from_dict({}).metrics.report_to == ""


def test_mlflow_records_the_steps_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's SQLite store
    trackers = open_trackers(("mlflow",), tmp_path, {"optimizer.lr": 1e-5}, resumed=False)
    for step in (1, 2):
        trackers[0].log({"loss": 3.0 / step}, step)
    run_id = mlflow.active_run().info.run_id
    trackers[0].close()
    history = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri(tmp_path)).get_metric_history(
        run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 1.5)]
