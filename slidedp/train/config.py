"""The `slidedp train` configuration: a typed schema, YAML/TOML files and `key=value` overrides."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_type_hints

from slidedp.budget import Budget


@dataclass(frozen=True)
class TrainConfig:
    """Keys of a training run. `model="smollm2"` and `data="stdlib"` make the embedded default job."""

    # what to train, on what
    model: str = "smollm2"  # "smollm2", a local Hugging Face folder, or a preset shape (random init)
    tokenizer: str = ""  # "": the model folder's own ("smollm2" for a preset); or a folder, or "smollm2"
    data: str = "stdlib"  # "stdlib", or .txt/.jsonl/.parquet files and folders, comma-separated
    packing: bool = True  # pack examples into full rows; false: one example a row, padded and masked
    max_rows: int = 0  # rows of data to use, 0: all (the stdlib default job uses 16)
    val_fraction: float = 0.0  # rows held out for the validation loss
    val_every: int = 0  # validation loss every this many steps (and at the end); 0: at the end only
    output_dir: str = "runs/default"
    # the step
    max_steps: int = 24
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 128
    precision: str = "auto"  # "auto" (bf16 on a GPU, fp32 on CPU) | "bf16" | "fp32"
    device: str = "auto"
    world_size: int = 1
    budget: str = "16GiB"
    # the optimizer
    lr: float = 1e-4
    lr_schedule: str = "constant"  # "constant" | "linear" | "cosine" (decay to min_lr at max_steps)
    warmup_steps: int = 0  # linear warm-up from 0 to lr over these steps
    min_lr: float = 0.0
    weight_decay: float = 0.0
    no_decay_groups: bool = True  # no weight decay on norms, biases and embeddings
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    max_skipped_steps: int = 10  # abort after this many consecutive steps skipped for non-finite gradients; 0: never
    # checkpoints
    save_every: int = 0  # checkpoint every this many steps (and always at the end); 0: at the end only
    keep_last: int = 2  # checkpoints kept in output_dir/checkpoints
    resume: bool = False  # continue from the latest checkpoint in output_dir (start fresh if none)
    overwrite: bool = False  # a fresh run may delete the checkpoints already in output_dir
    # the rest
    seed: int = 0
    log_every: int = 1
    progress: bool = True  # progress bar (tqdm when installed)
    tensorboard: bool = True  # TensorBoard scalars when the tensorboard package is installed

    def validate(self) -> "TrainConfig":
        positive = ("max_steps", "batch_size", "grad_accum", "seq_len", "world_size", "log_every", "keep_last")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be >= 1, got {getattr(self, key)}")
        for key in ("max_rows", "val_every", "warmup_steps", "save_every", "max_skipped_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"config key {key!r} must be >= 0, got {getattr(self, key)}")
        for key in ("lr", "min_lr", "weight_decay", "max_grad_norm", "adam_eps"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"config key {key!r} must be a finite number >= 0, got {getattr(self, key)}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be in [0, 1), got {getattr(self, key)}")
        if self.seq_len < 2:
            raise ValueError(f"config key 'seq_len' must be >= 2, got {self.seq_len}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"config key 'precision' must be auto, bf16 or fp32, got {self.precision!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"config key 'device' must be auto, cuda or cpu, got {self.device!r}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"config key 'lr_schedule' must be constant, linear or cosine, got {self.lr_schedule!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"config key 'min_lr' ({self.min_lr}) must not exceed 'lr' ({self.lr})")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"config key 'val_fraction' must be in [0, 1), got {self.val_fraction}")
        try:
            Budget.parse(self.budget)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config key 'budget': {exc}") from None
        for key in ("model", "data", "output_dir"):
            if not getattr(self, key).strip():
                raise ValueError(f"config key {key!r} must not be empty")
            if "\0" in getattr(self, key):
                raise ValueError(f"config key {key!r} contains a NUL character")
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
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"config key {key!r} must be an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise TypeError(f"config key {key!r} must be a number, got {value!r}")
        if not isinstance(value, (str, int, float)):
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
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"config file {path}: cannot be read as UTF-8 text ({exc})") from None
        if p.suffix == ".toml":
            import tomllib

            try:
                values = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            try:
                values = yaml.safe_load(text) or {}  # safe_load: plain values only, no Python objects
            except yaml.YAMLError as exc:
                raise ValueError(f"config file {path}: not valid YAML ({' '.join(str(exc).split())})") from None
        elif p.suffix == ".json":
            try:
                values = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"config file {path}: not valid JSON ({exc})") from None
        else:
            raise ValueError(f"config file {path}: expected .yaml, .yml, .toml or .json")
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
    if isinstance(values.get("data"), list):  # a YAML/TOML list of files and folders
        if not all(isinstance(v, str) for v in values["data"]):
            raise TypeError(f"config key 'data': a list must hold file or folder names, got {values['data']!r}")
        values["data"] = ",".join(values["data"])
    unnamed = [k for k in values if not isinstance(k, str)]
    if unnamed:
        raise ValueError(f"config file {path}: keys must be names, got {unnamed[0]!r}")
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
