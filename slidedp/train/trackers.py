"""Experiment trackers that `slidedp train` also logs to (`report_to`), always offline: Weights &
Biases in offline mode (`<output_dir>/wandb`, `wandb sync` uploads it later) and MLflow in a local
SQLite store (`<output_dir>/mlflow.db`; `mlflow ui --backend-store-uri sqlite:///PATH` reads it), or
the store MLFLOW_TRACKING_URI names. Neither is required: a
tracker named but not installed is refused when the config is checked, before anything loads."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

TRACKERS = ("wandb", "mlflow")


def parse_report_to(value: str) -> tuple[str, ...]:
    """`report_to` ("", "wandb", "mlflow" or "wandb,mlflow") as tracker names; ValueError naming an
    unknown one or one whose package is not installed."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"config key 'report_to': unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"config key 'report_to' names {name}, which is not installed: `pip install {name}`, "
                             f"or leave {name} out of report_to")
    return names


class WandbTracker:
    """A W&B run in offline mode under `<out_dir>/wandb`."""

    def __init__(self, out_dir: Path, config: dict, resumed: bool):
        wandb = importlib.import_module("wandb")
        self.run = wandb.init(project="slidedp", name=out_dir.name, dir=str(out_dir), mode="offline",
                              config=config, resume="allow" if resumed else None)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log({f"train/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in `<out_dir>/mlflow.db` (SQLite, MLflow's local store), unless the environment's
    MLFLOW_TRACKING_URI names another store."""

    def __init__(self, out_dir: Path, config: dict, resumed: bool):
        self.mlflow = importlib.import_module("mlflow")
        self.mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or tracking_uri(out_dir))
        self.mlflow.start_run(run_name=out_dir.name)
        self.mlflow.log_params({k: str(v) for k, v in config.items()})

    def log(self, scalars: dict, step: int) -> None:
        self.mlflow.log_metrics({f"train/{k}": float(v) for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def tracking_uri(out_dir: Path) -> str:
    """MLflow's store of a run folder: a SQLite file in it."""
    return f"sqlite:///{(out_dir.resolve() / 'mlflow.db').as_posix()}"


def open_trackers(names: tuple[str, ...], out_dir: Path, config: dict, *, resumed: bool) -> list:
    """One tracker per name, each given the run's flat config."""
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[name](out_dir, config, resumed) for name in names]


def flat_keys(sectioned: dict) -> dict:
    """A sectioned config (`TrainConfig.to_dict()`) as dotted keys: {"optimizer.lr": 1e-5, ...}."""
    return {f"{section}.{key}": value for section, keys in sectioned.items() for key, value in keys.items()}
