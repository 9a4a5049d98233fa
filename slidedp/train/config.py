"""The `slidedp train` configuration: a typed schema, YAML/TOML files and `key=value` overrides."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_type_hints


@dataclass(frozen=True)
class TrainConfig:
    """Keys of a training run. `model="smollm2"` and `data="stdlib"` make the embedded default job."""

    model: str = "smollm2"  # "smollm2" or a local Hugging Face folder
    data: str = "stdlib"  # "stdlib" (the Python standard library's sources) or a .txt file/folder
    output_dir: str = "runs/default"
    max_steps: int = 24
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 128
    max_rows: int = 16  # packed rows of data to train on (epochs repeat them)
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    precision: str = "auto"  # "auto" (bf16 on a GPU, fp32 on CPU) | "bf16" | "fp32"
    device: str = "auto"
    world_size: int = 1
    budget: str = "16GiB"
    save_every: int = 0  # 0: no intermediate checkpoints
    resume: bool = False
    seed: int = 0
    log_every: int = 1

    def validate(self) -> "TrainConfig":
        positive = ("max_steps", "batch_size", "grad_accum", "seq_len", "max_rows", "world_size", "log_every")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be >= 1, got {getattr(self, key)}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"config key 'precision' must be auto, bf16 or fp32, got {self.precision!r}")
        if self.lr < 0 or self.weight_decay < 0 or self.max_grad_norm < 0 or self.save_every < 0:
            raise ValueError("config keys lr, weight_decay, max_grad_norm and save_every must be >= 0")
        if self.save_every or self.resume:
            raise ValueError("config keys 'save_every' and 'resume': checkpoints are not available in this "
                             "version of slidedp; leave them at 0 / false")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(key: str, value, typ):
    """A value of the schema's type, from a file value or an override string; errors name the key."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TypeError(f"config key {key!r} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise TypeError(f"config key {key!r} must be an integer, got {value!r}")
        try:
            if isinstance(value, str):
                return int(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except ValueError:
            raise TypeError(f"config key {key!r} must be an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise TypeError(f"config key {key!r} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TypeError(f"config key {key!r} must be a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise TypeError(f"config key {key!r} must be a string, got {value!r}")
    return str(value)


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """Defaults, then the YAML/TOML file, then `key=value` overrides; unknown keys are refused."""
    values: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        text = p.read_text()
        if p.suffix == ".toml":
            import tomllib

            values = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        elif p.suffix == ".json":
            values = json.loads(text)
        else:
            raise ValueError(f"config file {path}: expected .yaml, .yml, .toml or .json")
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value")
        values[key.strip()] = value.strip()
    hints = get_type_hints(TrainConfig)
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return TrainConfig(**{k: _coerce(k, v, hints[k]) for k, v in values.items()}).validate()
