"""The `slidedp train` configuration: typed sections, YAML/TOML/JSON files and `key=value` overrides.

`TrainConfig` holds one frozen section a concern (`cfg.optimizer.lr`, `cfg.checkpoint.save_every`).
Every key lives in exactly one section and its name is unique across them, so a file or an override
may name it flat (`lr: 1e-4`, `lr=1e-4`) or in its section (`optimizer: {lr: 1e-4}`,
`optimizer.lr=1e-4`); both load to the same config. `config.json` is written sectioned
(`TrainConfig.to_dict`); older flat ones load as well.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import get_type_hints

import yaml

from slidedp.budget import parse_with_unit
from slidedp.costmodel.hardware import LINKS, load_link, resolve_link
from slidedp.train.schedule import SCHEDULES, check_schedule
from slidedp.train.trackers import parse_report_to


MAX_SEED = 2**32 - 1


def _key(default, help: str):
    """A config key: its default and its one-line meaning (`slidedp train --help` lists them)."""
    return field(default=default, metadata={"help": help})


def _check_at_least(section, *keys: str, least: int = 1) -> None:
    for key in keys:
        if getattr(section, key) < least:
            raise ValueError(f"config key {key!r} must be >= {least}, got {getattr(section, key)}")


def link_rate(link: str) -> float:
    """The `link` key as bytes/s: a costmodel.hardware.LINKS preset, a number, or a link.json file of
    `slidedp calibrate --link`; a ValueError naming the key otherwise."""
    try:
        return resolve_link(float(link))
    except ValueError:
        pass
    try:
        if link in LINKS:
            return resolve_link(link)
        if link.endswith(".json") or Path(link).is_file():
            return load_link(link)
        return resolve_link(link)
    except ValueError as exc:
        raise ValueError(f"config key 'link': {exc}") from None


def _check_text(section, *keys: str) -> None:
    for key in keys:
        if not getattr(section, key).strip():
            raise ValueError(f"config key {key!r} must not be empty")
        if "\0" in getattr(section, key):
            raise ValueError(f"config key {key!r} contains a NUL character")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What to train. `model="smollm2"` makes the embedded default job."""

    model: str = _key("smollm2", "smollm2, a local Hugging Face folder (download a Hub model first), or a "
                                 "preset shape with random weights (llama-tiny, qwen3-0.6b, ...)")
    tokenizer: str = _key("", "a folder or smollm2; empty: the model folder's own (smollm2 for a preset)")

    def validate(self) -> None:
        _check_text(self, "model")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """On what. `data="stdlib"` makes the embedded default job."""

    data: str = _key("stdlib", "stdlib (the default job's text), or .txt/.jsonl/.parquet files and folders "
                               "(or save_to_disk folders), comma-separated")
    encoding: str = _key("utf-8", "text encoding of the .txt files, decoded strictly (JSONL is always UTF-8)")
    packing: bool = _key(True, "pack examples into full rows; false: one example a row, padded and masked")
    max_rows: int = _key(0, "rows of data to use; 0: all (16 for stdlib)")
    chat_template: str = _key("", "a Jinja chat template, or a .jinja file, for chat data (messages or "
                                  "conversations); empty: the tokenizer's own")
    val_fraction: float = _key(0.0, "fraction of the rows held out for the validation loss")
    val_data: str = _key("", ".txt/.jsonl/.parquet files and folders (or save_to_disk folders), comma-separated, "
                             "for the validation loss (instead of val_fraction)")
    val_every: int = _key(0, "validation loss every this many steps (and at the end); 0: at the end only")

    def validate(self) -> None:
        _check_at_least(self, "max_rows", "val_every", least=0)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"config key 'val_fraction' must be in [0, 1), got {self.val_fraction}")
        if self.val_data and self.val_fraction > 0:
            raise ValueError(f"config keys 'val_data' and 'val_fraction' exclude each other: validate on the files "
                             f"of val_data ({self.val_data}) or on a held-out fraction of data, not both")
        for key in ("val_data", "chat_template"):
            if "\0" in getattr(self, key):
                raise ValueError(f"config key {key!r} contains a NUL character")
        if self.val_data and not self.val_data.strip(" ,"):
            raise ValueError("config key 'val_data' names no file")
        _check_text(self, "data", "encoding")
        try:
            codec = codecs.lookup(self.encoding)
        except LookupError:
            raise ValueError(f"config key 'encoding': unknown text encoding {self.encoding!r} (e.g. utf-8, "
                             "latin-1, cp1252)") from None
        if not getattr(codec, "_is_text_encoding", True):
            raise ValueError(f"config key 'encoding': {self.encoding!r} is not a text encoding")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The step and the length of the run."""

    max_steps: int = _key(24, "optimizer steps of the run")
    batch_size: int = _key(4, "rows (sequences) per micro-batch")
    grad_accum: int = _key(1, "micro-batches per optimizer step")
    group_rows: bool | str = _key("auto", "let the plan group the batch_size x grad_accum rows of a rank's step "
                                          "into micro-batches of another number of rows, the fastest predicted (rows "
                                          "a step unchanged); auto: where the blocks are host-bound")
    seq_len: int = _key(128, "tokens per row (at most the model's max_position_embeddings)")
    seed: int = _key(0, "data order and random init, 0 .. 2**32 - 1")
    max_skipped_steps: int = _key(10, "stop after this many consecutive steps skipped for a non-finite "
                                      "gradient; 0: never")
    nonfinite: str = _key("skip", "a step whose gradient is not finite: skip (nothing changes) or stop the run; "
                                  "stop, without clipping, lets the plan stream the gradients into the update "
                                  "(no gradient in host RAM)")

    def validate(self) -> None:
        _check_at_least(self, "max_steps", "batch_size", "grad_accum", "seq_len")
        _check_at_least(self, "max_skipped_steps", least=0)
        _check_at_least(self, "seq_len", least=2)
        if self.nonfinite not in ("skip", "stop"):
            raise ValueError(f"config key 'nonfinite' must be skip or stop, got {self.nonfinite!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"config key 'seed' must be in 0..{MAX_SEED} (2**32 - 1, the range torch, numpy and "
                             f"random all accept), got {self.seed}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Where and how the engine runs."""

    device: str = _key("auto", "auto, cuda or cpu")
    precision: str = _key("auto", "auto (bf16 on a GPU, fp32 on the CPU), bf16 or fp32")
    budget: str = _key("16GiB", "GPU memory budget per rank, with a unit (24GiB, 512MiB)")
    world_size: int = _key(0, "data-parallel ranks (GPUs, or CPU processes); 0: torchrun's WORLD_SIZE under "
                              "torchrun (every host's ranks), else 1")
    host_memory: str = _key("", "host RAM the plan may take, with a unit (100GiB); empty: what is available")
    link: str = _key("", "several hosts (torchrun --nnodes N): each host's rate into the network, a preset "
                         "(eth-1x100, ib-4x400, ...), bytes/s, or the link.json of slidedp calibrate --link; "
                         "unused on one host")

    def validate(self) -> None:
        _check_at_least(self, "world_size", least=0)
        if self.link and not self.link.endswith(".json"):  # a link.json is read when the run starts
            link_rate(self.link)
        if self.host_memory != "":
            try:
                parse_with_unit(self.host_memory, "host_memory")
            except (TypeError, ValueError) as exc:
                raise ValueError(f"config key 'host_memory': {exc}") from None
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"config key 'precision' must be auto, bf16 or fp32, got {self.precision!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"config key 'device' must be auto, cuda or cpu, got {self.device!r}")
        try:
            parse_with_unit(self.budget, "budget")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config key 'budget': {exc}") from None


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW."""

    lr: float = _key(1e-4, "AdamW learning rate (the peak of the schedule)")
    weight_decay: float = _key(0.0, "AdamW weight decay")
    no_decay_groups: bool = _key(True, "no weight decay on norms, biases and embeddings")
    adam_beta1: float = _key(0.9, "AdamW beta1")
    adam_beta2: float = _key(0.999, "AdamW beta2")
    adam_eps: float = _key(1e-8, "AdamW epsilon (> 0)")
    max_grad_norm: float = _key(1.0, "global gradient-norm clipping; 0: none")

    def validate(self) -> None:
        for key in ("lr", "weight_decay", "max_grad_norm", "adam_eps"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"config key {key!r} must be a finite number >= 0, got {getattr(self, key)}")
        if not self.adam_eps > 0:
            raise ValueError(f"config key 'adam_eps' must be > 0 (it keeps AdamW's division finite), got {self.adam_eps}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be in [0, 1), got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The learning rate over the steps (from `optimizer.lr`, to `min_lr` at `training.max_steps`)."""

    lr_schedule: str = _key("constant", "constant, constant_with_warmup, linear, cosine (decay to min_lr at "
                                        "max_steps) or inverse_sqrt: transformers.get_scheduler's schedules")
    warmup_steps: int = _key(0, "linear warm-up from 0 to lr over these steps")
    min_lr: float = _key(0.0, "the learning rate the linear or cosine decay ends at")

    def validate(self) -> None:
        _check_at_least(self, "warmup_steps", least=0)
        if not (math.isfinite(self.min_lr) and self.min_lr >= 0):
            raise ValueError(f"config key 'min_lr' must be a finite number >= 0, got {self.min_lr}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"config key 'lr_schedule' must be {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}, "
                             f"got {self.lr_schedule!r}")
        check_schedule(self.lr_schedule, self.min_lr)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The run folder and its checkpoints."""

    output_dir: str = _key("runs/default", "the run folder (config, metrics, checkpoints)")
    save_every: int = _key(0, "a checkpoint every this many steps (and always at the end); 0: at the end only")
    keep_last: int = _key(2, "checkpoints kept in output_dir/checkpoints")
    resume: bool | str = _key(False, "true: continue from the latest checkpoint in output_dir (start fresh if "
                                     "none); a checkpoint folder: continue from that one")
    overwrite: bool = _key(False, "a fresh run may delete the checkpoints already in output_dir")

    def validate(self) -> None:
        _check_at_least(self, "keep_last")
        _check_at_least(self, "save_every", least=0)
        _check_text(self, "output_dir")
        if isinstance(self.resume, str):
            _check_text(self, "resume")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What the run reports while it trains."""

    log_every: int = _key(1, "a stderr line every this many steps")
    progress: bool = _key(True, "progress bar (tqdm when installed)")
    tensorboard: bool = _key(True, "TensorBoard scalars when the tensorboard package is installed")
    report_to: str = _key("", "also log to wandb and/or mlflow (comma-separated), offline, into the run folder")

    def validate(self) -> None:
        _check_at_least(self, "log_every")
        parse_report_to(self.report_to)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Keys of a training run, in sections; the defaults make the embedded default job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> "TrainConfig":
        for f in fields(self):
            getattr(self, f.name).validate()
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"config key 'min_lr' ({self.schedule.min_lr}) must not exceed 'lr' ({self.optimizer.lr})")
        return self

    def to_dict(self) -> dict:
        """Sectioned: `{"optimizer": {"lr": ...}, ...}`, as `load_config` and `from_dict` read it."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(values: dict, where: str = "config") -> "TrainConfig":
        """A validated config from flat and/or sectioned keys (a file's mapping, `to_dict`'s output)."""
        return _build(_normalize(values, where))


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(TrainConfig)}
SECTION_OF: dict[str, str] = {k.name: s for s, typ in SECTIONS.items() for k in fields(typ)}  # flat key -> section
assert len(SECTION_OF) == sum(len(fields(t)) for t in SECTIONS.values()), "a key in two sections"


_HINTS: dict[str, type] = {k: v for typ in SECTIONS.values() for k, v in get_type_hints(typ).items()}


def keys_help() -> str:
    """Every config key, by section, with its default and meaning (`slidedp train --help`)."""
    lines = []
    for section, typ in SECTIONS.items():
        lines.append(f"{section}:")
        for f in fields(typ):
            default = json.dumps(f.default) if not isinstance(f.default, str) else (f.default or '""')
            lines.append(f"  {f.name} = {default}: {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _normalize(values: dict, where: str) -> dict:
    """Flat key -> value, from a mapping of flat keys (`lr`), sections (`optimizer: {lr: ...}`) and
    dotted keys (`optimizer.lr`). A section name that is also a key (`model`, `data`) is the section
    when its value is a mapping. Unknown keys, keys in the wrong section and keys given twice are
    refused, naming them."""
    flat: dict = {}
    unknown: list[str] = []
    for key, value in values.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be names, got {key!r}")
        section, dot, name = key.partition(".")
        if dot:
            entries = [(section, name, value)]
        elif key in SECTIONS and (isinstance(value, dict) or key not in SECTION_OF):
            if value is None:  # an empty YAML section
                value = {}
            if not isinstance(value, dict):
                raise ValueError(f"{where}: config section {key!r} must be a mapping of keys to values, got {value!r}")
            entries = [(key, k, v) for k, v in value.items()]
        else:
            entries = [(None, key, value)]
        for section, name, value in entries:
            if not isinstance(name, str):
                raise ValueError(f"{where}: keys of section {section!r} must be names, got {name!r}")
            dotted = name if section is None else f"{section}.{name}"
            if name not in SECTION_OF or (section is not None and SECTION_OF[name] != section):
                hint = f" ({name!r} belongs in section {SECTION_OF[name]!r})" if name in SECTION_OF else ""
                close = difflib.get_close_matches(name, SECTION_OF, n=1) if name not in SECTION_OF else []
                if close:
                    hint = f" (did you mean {close[0]!r}?)"
                unknown.append(dotted + hint)
                continue
            if name in flat:
                raise ValueError(f"{where}: config key {name!r} is given twice (flat and in section "
                                 f"{SECTION_OF[name]!r}, or twice in it)")
            if name in ("data", "val_data") and isinstance(value, list):  # a YAML/TOML list of files and folders
                if not all(isinstance(v, str) for v in value):
                    raise TypeError(f"config key {name!r}: a list must hold file or folder names, got {value!r}")
                value = ",".join(value)
            flat[name] = value
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(SECTION_OF))}"
                         f"; in sections: {', '.join(SECTIONS)})")
    return flat


def _build(flat: dict) -> TrainConfig:
    """The validated config of flat key -> value (values coerced to the schema's types)."""
    per_section: dict[str, dict] = {s: {} for s in SECTIONS}
    for key, value in flat.items():
        per_section[SECTION_OF[key]][key] = _coerce(key, value, _HINTS[key])
    return TrainConfig(**{s: SECTIONS[s](**kv) for s, kv in per_section.items()}).validate()


def _coerce(key: str, value, typ):

    """A value of the schema's type, from a file value or an override string; errors name the key."""
    if key == "resume":  # true/false, or a checkpoint folder
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("true", "false", "1", "0", "yes", "no", ""):
                return value.strip().lower() in ("true", "1", "yes")
            return value
        raise TypeError(f"config key 'resume' must be true, false or a checkpoint folder, got {value!r}")
    if key == "group_rows":  # true/false, or auto
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("auto", "true", "false", "1", "0", "yes", "no"):
            word = value.strip().lower()
            return "auto" if word == "auto" else word in ("true", "1", "yes")
        raise TypeError(f"config key 'group_rows' must be true, false or auto, got {value!r}")
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


class DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list, path) -> dict:
    """A JSON object's mapping; a key given twice is refused (json's default keeps the last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"config file {path}: key {key!r} is given twice")
        out[key] = value
    return out


def _unique_key_loader(path):
    """A yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
                if duplicate:
                    raise DuplicateKeyError(f"config file {path}: key {key!r} is given twice "
                                            f"(line {key_node.start_mark.line + 1})")
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """Defaults, then the YAML/TOML/JSON file, then `key=value` overrides (flat or dotted keys, as
    `lr=1e-4` or `optimizer.lr=1e-4`); unknown keys are refused."""
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
            try:
                values = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
        elif p.suffix in (".yaml", ".yml"):
            loader = _unique_key_loader(path)(text)  # a SafeLoader: plain values only
            try:
                values = loader.get_single_data() or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"config file {path}: not valid YAML ({' '.join(str(exc).split())})") from None
            except RecursionError:
                raise ValueError(f"config file {path}: not valid YAML (nested too deeply)") from None
            finally:
                loader.dispose()
        elif p.suffix == ".json":
            try:
                values = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
            except DuplicateKeyError:
                raise
            except ValueError as exc:
                raise ValueError(f"config file {path}: not valid JSON ({exc})") from None
            except RecursionError:
                raise ValueError(f"config file {path}: not valid JSON (nested too deeply)") from None
        else:
            raise ValueError(f"config file {path}: expected .yaml, .yml, .toml or .json")
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
    flat = _normalize(values, f"config file {path}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like key=value")
        flat.update(_normalize({key.strip(): value.strip()}, f"override {item!r}"))  # the last one wins
    return _build(flat)
