"""`slidedp train`: load a model and data, compile, run the steps, validate, checkpoint, resume.

The run's folder (`output_dir`):

    .slidedp.lock                  the lock of the folder (runlock.py): one `slidedp train` or export at a time
    config.json                    the resolved config of the run, in sections (`load_config` reads it)
    plan.json                      the plan the run follows (`slidedp inspect RUN/plan.json` prints it whole;
                                   `slidedp report RUN/plan.json --html OUT.html` draws it)
    metrics.jsonl                  one record per step (see metrics.py)
    checkpoints/step-00000024/     the engine's state (slidedp/run/checkpoint.py), plus this job's
                                   `trainer_state.json` (step, schedule, data position, config)
                                   and the tokenizer in `hf/`: `slidedp export` needs nothing else
    tensorboard/                   when the tensorboard package is installed

A checkpoint is written every `save_every` steps and at the end; the last `keep_last` are kept.
`resume=PATH` continues from that checkpoint folder (verified the same way; a folder that is not a
checkpoint is refused, naming it). `resume=true` continues from the newest checkpoint that verifies (newer ones skipped are named on
stderr) exactly: the same weights, moments, AdamW step, learning rate, data position and RNG
state, so N steps + resume + N steps give bitwise the same result as 2N steps (CPU, fp32). Keys
changed on resume: `compare_resumed_config`. `overwrite=true` deletes the old checkpoints only
once the model, the data and the plan have loaded.

Under torchrun (`torchrun [--nnodes N] --nproc-per-node G -m slidedp train CONFIG`) every process is
one rank and runs `run` (ranks.py): rank 0 decides from the run folder, holds its lock and writes the
run's files; with several hosts each host writes its own layer files of every checkpoint into the
one shared run folder (checked at start: `_run_folder`).

Faults: SIGINT or SIGTERM during a step lets the step finish, writes a checkpoint at that step and
stops with `TrainingInterrupted` (the command exits with 128 + the signal's number; a second
signal stops at once, leaving the previous checkpoint). A step whose gradient is not finite is
skipped by the engine (nothing changes) and logged; `max_skipped_steps` consecutive ones abort the
run with `NonFiniteGradientError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

import accelerate
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slidedp.budget import format_bytes
from slidedp.costmodel.hardware import LINKS, PRESETS as HARDWARE_PRESETS, resolve_hardware
from slidedp.errors import NonFiniteGradientError, TrainingInterrupted
from slidedp.run.checkpoint import (
    ENGINE_JSON, HF_DIR, MANIFEST, CheckpointError, check_rng_files, read_checkpoint_json, read_engine_meta,
    remove_stale_temps, verify_checkpoint,
)
from slidedp.run.weights import checkpoint_shapes
from slidedp.scheduler.plan import Plan
from slidedp.train.config import TrainConfig, link_rate
from slidedp.train.data import PackedDataset, read_document, stdlib_dataset, stdlib_source_files
from slidedp.train.metrics import (
    MetricsLogger, device_memory_bytes, host_rss_bytes, model_flops_per_step, peak_flops_per_s,
)
from slidedp.train.ranks import Ranks, launched_hosts, resolve_world_size, start_ranks
from slidedp.train.runlock import CHECKPOINTS, LOCK_FILE, run_folder_lock
from slidedp.train.trackers import flat_keys, open_trackers, parse_report_to
from slidedp.train.schedule import lr_at, schedule_state
from slidedp.train.shapes import PRESETS, preset_config, refuse_hub_id
from slidedp.train.smollm2 import ensure_smollm2
from slidedp.train.loading import load_dataset
from slidedp.train.sources import Example, build_rows, find_data_files

TRAINER_STATE = "trainer_state.json"
TRAINER_FORMAT = 1
STDLIB_ROWS = 16  # rows of the default job when max_rows is 0


_QUIET = {"on": False}  # under torchrun, ranks other than 0 print nothing (rank 0 speaks for the run)


def _log(msg: str) -> None:
    if not _QUIET["on"]:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Model, tokenizer, data


def empty_model(folder: Path):
    """The folder's model in fp32 with its parameters on the meta device (buffers real): compile
    reads its weights from the folder straight into the host state (`weights_of`), so the host never
    holds a second copy of them."""
    with accelerate.init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)


def weights_of(cfg: TrainConfig, model):
    """compile's `weights=` for the model of `load_model_and_tokenizer`: its folder when the model
    was built empty, else None (its own weights)."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return None
    if cfg.model.model == "smollm2":
        return ensure_smollm2()
    return Path(cfg.model.model).expanduser()


def load_model_and_tokenizer(cfg: TrainConfig):
    """(model, tokenizer): a Hugging Face folder or the SmolLM2 default (built empty: `empty_model`),
    or a preset with random init."""
    folder = None
    if cfg.model.model == "smollm2":
        folder = ensure_smollm2()
        model = empty_model(folder)
    elif cfg.model.model in PRESETS:
        torch.manual_seed(cfg.training.seed)
        model = AutoModelForCausalLM.from_config(preset_config(cfg.model.model), dtype=torch.float32)
    else:
        folder = Path(cfg.model.model).expanduser()
        refuse_hub_id(cfg.model.model, "config key 'model'")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"config key 'model': {cfg.model.model} is neither a Hugging Face folder (no "
                                    f"config.json) nor 'smollm2' nor a preset ({', '.join(PRESETS)})")
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"config key 'model': {cfg.model.model} holds no .safetensors weights; slidedp does not "
                             "read pickled weights (pytorch_model.bin); convert them with save_pretrained("
                             "..., safe_serialization=True) in a trusted environment")
        try:
            checkpoint_shapes(folder)  # every file's header readable, before anything is built
            model = empty_model(folder)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
            raise ValueError(f"config key 'model': cannot load the weights of {folder} "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    source = cfg.model.tokenizer or (str(folder) if folder is not None else "smollm2")
    if source == "smollm2":
        source = str(ensure_smollm2())
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"config key 'tokenizer': no tokenizer could be loaded from {source} ({exc}); "
                         "set tokenizer=FOLDER (a folder with tokenizer files) or tokenizer=smollm2") from None
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer ({source}) has {len(tokenizer)} tokens, more than the model's "
                         f"vocabulary of {vocab}")
    return model, tokenizer


def check_data_paths(cfg: TrainConfig) -> None:
    """Refuse a `data` or `val_data` that names a missing file or folder, or a file of an unsupported
    kind, naming the key: `run` calls it before loading the model (reads no data)."""
    if cfg.data.data != "stdlib":
        find_data_files(cfg.data.data, "data")
    if cfg.data.val_data:
        find_data_files(cfg.data.val_data, "val_data")


def load_data(cfg: TrainConfig, tokenizer):
    """The whole dataset (a `PackedDataset`), before the validation split."""
    data, seq_len, seed = cfg.data, cfg.training.seq_len, cfg.training.seed
    if data.data != "stdlib":
        return load_dataset(data.data, tokenizer, seq_len, packing=data.packing, max_rows=data.max_rows or None,
                            seed=seed, encoding=data.encoding, chat_template=data.chat_template)
    max_rows = data.max_rows or STDLIB_ROWS
    if data.packing:
        return stdlib_dataset(tokenizer, seq_len, max_rows=max_rows, seed=seed)
    texts = (read_document(f) for f in stdlib_source_files())
    examples = (Example(text) for text in texts if text.strip())  # empty __init__.py files: nothing to train
    rows = build_rows(examples, tokenizer, seq_len, packing=False, max_rows=max_rows)
    return PackedDataset(rows["input_ids"], seed=seed, labels=rows["labels"],
                         attention_mask=rows["attention_mask"])


def validation_loss(engine, val, rows: int) -> float:
    """Token-weighted mean loss over the validation rows (`Engine.evaluate`, no update)."""
    total, tokens = 0.0, 0
    for batch in val.field_batches(rows):
        labels = batch.labels if batch.labels is not None else batch.input_ids
        n = int((labels[:, 1:] != -100).sum())
        if n:
            total += engine.evaluate(batch.input_ids, batch.labels, batch.attention_mask) * n
            tokens += n
    return total / tokens if tokens else float("nan")


# --------------------------------------------------------------------------------------------
# Checkpoints of the run


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints (those with a manifest), by increasing step."""
    root = Path(output_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file():
                try:
                    found.append((int(p.name[5:]), p))
                except ValueError:
                    pass
    return sorted(found)


def save_run_checkpoint(engine, output_dir: Path, step: int, trainer_state: dict, tokenizer,
                        keep_last: int, ranks: Ranks | None = None) -> Path:
    """The engine's state plus the trainer state and the tokenizer, atomically; prune old ones.
    Under torchrun a collective of every rank (`Engine.save_checkpoint`): with several hosts each
    host writes its own layer files, rank 0 the rest, this job's files and the manifest."""
    ranks = ranks or Ranks()
    root = output_dir / CHECKPOINTS
    if ranks.writer:
        remove_stale_temps(root)
    target = root / f"step-{step:08d}"

    def add(writer) -> None:
        hf_dir = writer.path(f"{HF_DIR}/tokenizer_config.json").parent  # beside the model's config
        tokenizer.save_pretrained(str(hf_dir))
        writer.add_folder(HF_DIR)
        writer.json(TRAINER_STATE, trainer_state)

    engine.save_checkpoint(target, add=add)
    # newer ones (left by a run that resumed from an older checkpoint, when the newest did not verify)
    # are not counted: they are replaced when the run reaches their step
    if ranks.writer:
        for _, old in [c for c in list_checkpoints(output_dir) if c[0] <= step][:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _bad(folder: Path, key: str, what: str, value) -> CheckpointError:
    return CheckpointError(f"checkpoint {folder}: {TRAINER_STATE} key {key!r} must be {what}, got {value!r} "
                           "(altered, or written by another program)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_trainer_state(folder: Path) -> dict:
    """trainer_state.json with every key the resume reads checked (a `CheckpointError` names the
    file and the key); `old_config` added: the checkpoint's config as a `TrainConfig`."""
    state = read_checkpoint_json(folder, TRAINER_STATE, fmt=TRAINER_FORMAT, what="trainer state",
                                 missing="it was not written by `slidedp train` and cannot be resumed by it")
    for key, typ in (("step", int), ("data", dict), ("config", dict)):
        if not isinstance(state.get(key), typ) or isinstance(state.get(key), bool):
            raise CheckpointError(f"checkpoint {folder}: {TRAINER_STATE} key {key!r} is missing or not "
                                  f"a{'n' if typ is int else ''} {typ.__name__} ({state.get(key)!r})")
    if state["step"] < 0:
        raise CheckpointError(f"checkpoint {folder}: {TRAINER_STATE} key 'step' is negative ({state['step']})")
    for key in ("tokens_seen", "consecutive_skips"):
        if key in state and not (_is_int(state[key]) and state[key] >= 0):
            raise _bad(folder, key, "an integer >= 0", state[key])
    if state.get("val_loss") is not None and not isinstance(state["val_loss"], (int, float)):
        raise _bad(folder, "val_loss", "a number or null", state["val_loss"])
    data = state["data"]
    for key in ("epoch", "position", "num_rows", "seed"):
        if not (_is_int(data.get(key)) and data[key] >= 0):
            raise _bad(folder, f"data.{key}", "an integer >= 0", data.get(key))
    if not (_is_int(data.get("seq_len")) and data["seq_len"] > 0):
        raise _bad(folder, "data.seq_len", "an integer > 0", data.get("seq_len"))
    if not isinstance(data.get("shuffle"), bool):
        raise _bad(folder, "data.shuffle", "true or false", data.get("shuffle"))
    if not isinstance(data.get("fingerprint"), str):
        raise _bad(folder, "data.fingerprint", "a string", data.get("fingerprint"))
    try:  # sectioned, or flat as checkpoints of earlier versions wrote it
        state["old_config"] = TrainConfig.from_dict(state["config"], where=f"{folder / TRAINER_STATE} config")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: {TRAINER_STATE} key 'config' is not a valid config "
                              f"({' '.join(str(exc).split())})") from None
    return state


def _reusable_plan(folder: Path, state: dict, cfg: TrainConfig, device: torch.device, precision: str,
                   hosts: int = 1) -> Path | None:
    """The checkpoint's plan when the run's workload, budget, hosts and hardware have not changed."""
    try:  # sectioned, or flat as checkpoints of earlier versions wrote it
        old = TrainConfig.from_dict(state.get("config", {}), where=f"{folder / TRAINER_STATE} config")
    except (TypeError, ValueError):
        return None

    def workload(c: TrainConfig) -> tuple:
        return (c.model.model, c.engine.budget, c.engine.world_size or 1, c.training.batch_size, c.training.seq_len,
                c.training.grad_accum, c.training.group_rows)

    if workload(old) != workload(cfg) or state.get("device") != device.type or state.get("precision") != precision:
        return None
    if state.get("hosts", 1) != hosts or (hosts > 1 and old.engine.link != cfg.engine.link):
        return None
    try:
        plan = Plan.load(folder / "plan.json")
    except (OSError, ValueError):
        return None
    return folder / "plan.json" if plan.hardware.get("name") == resolve_hardware(None, device.type).name else None


# --------------------------------------------------------------------------------------------
# Signals


class _Stop:
    signum: int | None = None


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """While inside, SIGINT/SIGTERM only set `.signum` of the yielded object: the loop finishes its
    step, writes a checkpoint and stops. A second signal raises KeyboardInterrupt at once (an
    unfinished checkpoint is discarded, the previous one stays). Off the main thread (where Python
    cannot install handlers) nothing is installed."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.signum is not None:
            raise KeyboardInterrupt
        stop.signum = signum
        # os.write: a print here could re-enter sys.stderr's buffer if the signal came during a print
        os.write(2, f"[slidedp] {signal.Signals(signum).name} received: stopping after this step and writing "
                    "a checkpoint (send it again to stop at once)\n".encode())

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------
# The run


# Config keys compared on resume (see README, "Fine-tune your own model", and docs/reliability.md).
# Refused: the data rows or their order follow from them, so the checkpoint's data position would
# point into other data.
REFUSED_ON_RESUME = {
    ("training", "seq_len"): "the data is cut into rows of seq_len tokens, so the checkpoint's data position "
                             "(rows consumed) would point into other rows",
    ("training", "seed"): "the order of the rows in every epoch follows from the seed",
    ("data", "packing"): "the rows of the data follow from it",
    ("data", "max_rows"): "the rows of the data follow from it",
    ("data", "val_fraction"): "which rows are held out for validation follows from it",
}
# Continued, with a note: the data position is kept in rows consumed, not steps, so a new batch
# shape reads on from the same row; the plan is solved for the new shape.
BATCH_SHAPE_KEYS = (("training", "batch_size"), ("training", "grad_accum"), ("engine", "world_size"))
# Continued, with a note: the schedule and the optimizer take the new values from the next step.
SCHEDULE_KEYS = (("optimizer", "lr"), ("schedule", "lr_schedule"), ("schedule", "warmup_steps"),
                 ("schedule", "min_lr"), ("training", "max_steps"), ("optimizer", "weight_decay"),
                 ("optimizer", "no_decay_groups"), ("optimizer", "adam_beta1"), ("optimizer", "adam_beta2"),
                 ("optimizer", "adam_eps"), ("optimizer", "max_grad_norm"))


def _value(cfg: TrainConfig, section: str, key: str):
    return getattr(getattr(cfg, section), key)


def compare_resumed_config(folder: Path, state: dict, cfg: TrainConfig) -> list[str]:
    """Notes on the keys that changed since the checkpoint was written (printed by `run`); a
    `CheckpointError` naming the key for a change that resuming cannot honour."""
    old = state["old_config"]
    for (section, key), why in REFUSED_ON_RESUME.items():
        was, now = _value(old, section, key), _value(cfg, section, key)
        if was != now:
            raise CheckpointError(
                f"config key {key!r} is {now!r} but was {was!r} in checkpoint {folder}: a run cannot be resumed "
                f"with another {key} ({why}); set {key}={was} to resume, or start a new run (another output_dir, "
                "or overwrite=true)")
    notes = []
    rows = [_value(c, "training", "batch_size") * _value(c, "training", "grad_accum") * _value(c, "engine", "world_size")
            for c in (old, cfg)]
    for section, key in BATCH_SHAPE_KEYS:
        was, now = _value(old, section, key), _value(cfg, section, key)
        if was != now:
            data = state["data"]
            notes.append(f"{key} changed on resume: {was} -> {now} (rows a step {rows[0]} -> {rows[1]}); the data "
                         f"continues at row {data['position']} of epoch {data['epoch']} (the position is kept in "
                         "rows consumed, not steps), and a plan for the new shape is used")
    for section, key in SCHEDULE_KEYS:
        was, now = _value(old, section, key), _value(cfg, section, key)
        if was != now:
            notes.append(f"{key} changed on resume: {was} -> {now}; the schedule and the optimizer use the new "
                         f"value from step {state['step'] + 1} on (weights, moments and AdamW step are the "
                         "checkpoint's)")
    return notes


def _check_resume_candidate(folder: Path) -> dict:
    """The trainer state of a checkpoint that can be resumed: every file verified, every metadata
    file's keys checked (a `CheckpointError` names the file and key otherwise)."""
    verify_checkpoint(folder, required=(ENGINE_JSON, TRAINER_STATE))
    read_engine_meta(folder)
    check_rng_files(folder)
    return read_trainer_state(folder)


def newest_usable_checkpoint(output_dir: Path, check, *, what: str) -> tuple[Path, object]:
    """(folder, check(folder)) of the newest checkpoint of the run for which `check` raises no
    `CheckpointError`; each newer one skipped is named on stderr with the reason. None usable: a
    `CheckpointError` listing each one and why."""
    skipped = []
    for step, folder in reversed(list_checkpoints(output_dir)):
        try:
            result = check(folder)
        except CheckpointError as exc:
            _log(f"[slidedp] skipping checkpoint {folder.name} (step {step}): {exc}")
            skipped.append(f"{folder.name}: {exc}")
            continue
        if skipped:
            _log(f"[slidedp] {what} from {folder.name} (step {step}), the newest checkpoint that verifies "
                 f"({len(skipped)} newer one(s) skipped, see above)")
        return folder, result
    raise CheckpointError(f"no checkpoint of {output_dir} can be used ({'; '.join(skipped) or 'none is complete'})")


def preset_guess(plan: Plan) -> bool:
    """Whether the plan's hardware profile is a guess for this machine, not a measurement of it: the
    "cpu" preset (no GPU), or an unknown GPU given a preset's figures (costmodel.hardware.resolve_hardware
    warns once of either). Its predicted step time is then a preset's estimate, not a prediction."""
    name = str(plan.hardware.get("name", ""))
    return name == "cpu" or (name not in HARDWARE_PRESETS and not name.startswith("calibrated:"))


def plan_brief(plan: Plan, plan_path: Path | str) -> str:
    """Three lines on the plan a run follows: what runs where; predicted step and peak memory; where
    the whole plan is (`Plan.summary()`, printed by --verbose)."""
    blocks = [d for d in plan.decisions if d.kind == "block"]
    host_layers = len(plan.decisions) - len(plan.device_state)
    where = [f"{len(blocks)} blocks streamed through a window of {plan.window} on the device",
             f"AdamW on the CPU for {host_layers - len(plan.streamed_updates)} layer(s)"]
    if plan.device_state:
        where.append(f"{len(plan.device_state)} layer(s) with optimizer state on the device")
    if plan.streamed_updates:
        where.append(f"{len(plan.streamed_updates)} updated on the device, state streamed")
    if plan.early_order:
        where.append("updates during the backward")
    acts: dict[str, int] = {}
    for d in blocks:
        acts[d.activation] = acts.get(d.activation, 0) + 1
    if acts:
        where.append("activations: " + ", ".join(f"{n} {a}" for a, n in sorted(acts.items())))
    w = plan.workload
    first = (f"[slidedp] schedule: {', '.join(where)} ({w.world_size} rank(s), {w.precision}, "
             f"hardware {plan.hardware.get('name', '?')})")
    step_s = plan.predicted.get("step_s") if plan.predicted else None
    if step_s is None:
        step = "step time not predicted"
    elif preset_guess(plan):
        step = f"step ~{step_s * 1e3:.4g} ms by the preset's nominal figures (not measured here: an estimate)"
    else:
        step = f"predicted step {step_s * 1e3:.4g} ms"
    memory = f"peak device memory {format_bytes(plan.peak_device_bytes)} of {format_bytes(plan.budget_bytes)}"
    if plan.peak_host_bytes:
        memory += f", host {format_bytes(plan.peak_host_bytes)}"
    return "\n".join([first, f"[slidedp] {step}; {memory}",
                      f"[slidedp] the whole plan and why: slidedp inspect {plan_path} (or train --verbose)"])


def run(cfg: TrainConfig, *, verbose: bool = False) -> dict:
    """Train as the config says; returns a summary (losses, steps, last checkpoint). `verbose`
    prints the plan's whole summary (its decisions and why) before the first step, else 3 lines.

    Under torchrun every process runs this as one rank (ranks.py): the world size is the launch's
    (config key `world_size` 0 or the same number), rank 0 writes the run's files and speaks, and
    with several hosts each host writes its own layer files of every checkpoint.

    The run folder is locked (runlock.py) for the whole run, by rank 0 under torchrun; nothing in
    it is changed or deleted before the model, the data and the plan have loaded."""
    cfg.validate()
    world_size = resolve_world_size(cfg.engine.world_size)
    if world_size != cfg.engine.world_size:  # the run's own number, in config.json and its checkpoints
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, world_size=world_size))
    device = torch.device(cfg.engine.device if cfg.engine.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    hosts = launched_hosts(world_size)
    if hosts > 1 and not cfg.engine.link:
        raise ValueError(f"config key 'link': {hosts} hosts, but the link between them is not given; set "
                         f"link= one of {', '.join(LINKS)}, a rate in bytes/s, or the link.json of `slidedp "
                         "calibrate --link` (the planner's figure for each host's rate into the network)")
    ranks = start_ranks(world_size, device)
    quiet, search_log = _QUIET["on"], logging.getLogger("slidedp")
    level = search_log.level
    if not ranks.writer:
        _QUIET["on"] = True
        search_log.setLevel(logging.ERROR)  # warnings too: rank 0 gives them for the run
    try:
        ranks.together(check_data_paths, cfg)  # a typo fails before the model loads and the run folder is made
        with _run_folder(cfg, ranks) as out:
            return _run_locked(cfg, out, verbose, ranks, device)
    finally:
        _QUIET["on"] = quiet
        search_log.setLevel(level)
        ranks.close()


# how long another host looks for rank 0's mark in the run folder (seconds)
SHARED_FOLDER_WAIT_S = float(os.environ.get("SLIDEDP_SHARED_FOLDER_WAIT_S", "10"))


@contextlib.contextmanager
def _run_folder(cfg: TrainConfig, ranks: Ranks):
    """The run folder, locked while inside. Under torchrun rank 0 alone holds the lock (one run, one
    holder); with several hosts the folder must be the same on every host (a shared file system: the
    hosts write each checkpoint together), which each other host's first rank checks by finding the
    mark rank 0 wrote into the lock file. A folder of a host's own is refused, naming the host."""
    out = Path(cfg.checkpoint.output_dir)
    if not ranks.launched:
        with run_folder_lock(out):
            yield out
        return
    with contextlib.ExitStack() as stack:
        mark = ranks.share(uuid.uuid4().hex)
        ranks.together(lambda: stack.enter_context(run_folder_lock(out, mark=f"run={mark}")) if ranks.writer else None)
        if ranks.hosts > 1:
            ranks.together(_check_shared_folder, out, mark, ranks) if ranks.leader and not ranks.writer \
                else ranks.together(lambda: None)
        yield out


def _check_shared_folder(out: Path, mark: str, ranks: Ranks) -> None:
    lock = out / LOCK_FILE
    deadline = time.monotonic() + SHARED_FOLDER_WAIT_S
    while True:
        try:
            if f"run={mark}" in lock.read_text(errors="replace"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"config key 'output_dir': {out} on host {ranks.host_index} is not the folder rank 0 "
                             f"(host 0) locked: with several hosts the run folder must be on a file system every "
                             "host sees (NFS or another shared one), where the hosts write each checkpoint together")
        time.sleep(0.1)


def _resume_decision(cfg: TrainConfig, out: Path, device: torch.device, precision: str, hosts: int) -> dict:
    """Rank 0's reading of the run folder: whether to overwrite, which checkpoint to resume from
    (verified), its trainer state and reusable plan."""
    existing = list_checkpoints(out)
    overwrite = False
    if not cfg.checkpoint.resume and existing:
        if not cfg.checkpoint.overwrite:
            raise ValueError(f"output_dir {out} already holds checkpoints (latest: step {existing[-1][0]}): "
                             "pass resume=true to continue from it, overwrite=true to start over (deleting "
                             "them), or another output_dir")
        overwrite = True  # deleted once everything has loaded, just before the first file is written
    trainer_state = resume_from = plan = None
    if isinstance(cfg.checkpoint.resume, str):  # a chosen checkpoint folder
        resume_from = Path(cfg.checkpoint.resume).expanduser()
        if not (resume_from / MANIFEST).is_file():
            raise CheckpointError(f"config key 'resume': {cfg.checkpoint.resume} is not a slidedp checkpoint "
                                  f"folder (no {MANIFEST}); give a checkpoints/step-NNNNNNNN folder, or "
                                  "resume=true for the latest checkpoint of output_dir")
        _log(f"[slidedp] resuming from {resume_from}: verifying it")
        trainer_state = _check_resume_candidate(resume_from)
        for note in compare_resumed_config(resume_from, trainer_state, cfg):
            _log(f"[slidedp] {note}")
        plan = _reusable_plan(resume_from, trainer_state, cfg, device, precision, hosts)
    elif cfg.checkpoint.resume:
        if existing:
            _log(f"[slidedp] resuming from {out / CHECKPOINTS}: verifying the latest checkpoint")
            remove_stale_temps(out / CHECKPOINTS)
            resume_from, trainer_state = newest_usable_checkpoint(out, _check_resume_candidate, what="resuming")
            for note in compare_resumed_config(resume_from, trainer_state, cfg):
                _log(f"[slidedp] {note}")
            plan = _reusable_plan(resume_from, trainer_state, cfg, device, precision, hosts)
        else:
            _log(f"[slidedp] resume=true but {out} holds no checkpoint: starting from step 0")
    return dict(overwrite=overwrite, resume_from=resume_from, trainer_state=trainer_state, plan=plan)


def _load_inputs(cfg: TrainConfig, trainer_state: dict | None, resume_from: Path | None):
    """(model, tokenizer, train rows, validation rows or None), the training rows at the checkpoint's
    position when resuming."""
    from slidedp import api

    _log(f"[slidedp] loading model {cfg.model.model}")
    model, tokenizer = load_model_and_tokenizer(cfg)
    api.check_positions(model, cfg.training.seq_len)  # before the data is cut into rows of seq_len
    data = load_data(cfg, tokenizer)
    train, val = (data, None)
    if cfg.data.val_data:
        val = load_dataset(cfg.data.val_data, tokenizer, cfg.training.seq_len, packing=cfg.data.packing,
                           seed=cfg.training.seed, encoding=cfg.data.encoding, chat_template=cfg.data.chat_template,
                           key="val_data")
    elif cfg.data.val_fraction > 0:
        train, val = data.split(cfg.data.val_fraction)
        if len(val) == 0:
            _log(f"[slidedp] val_fraction={cfg.data.val_fraction}: too few rows ({len(data)}) to hold out any")
            train, val = data, None
    if trainer_state is not None:
        try:
            train.load_state_dict(trainer_state["data"])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {resume_from}: its data position ({TRAINER_STATE} key 'data') does "
                                  f"not fit this run's data: {exc}; config key 'data' or 'tokenizer' changed since "
                                  "it was written") from None
    return model, tokenizer, train, val


def _check_same_data(ranks: Ranks, train, val) -> None:
    """Every rank draws the same global batches: the same rows, in the same order, on every host."""
    if not ranks.launched:
        return
    seen = ranks.all_gather((len(train), train.state_dict()["fingerprint"], len(val) if val is not None else None))
    for rank, mine in enumerate(seen):
        if mine != seen[0]:
            raise ValueError(f"{ranks.where(rank)} reads other data than rank 0 ({mine[0]} training rows, fingerprint "
                             f"{mine[1]}, against {seen[0][0]}, {seen[0][1]}): every host must see the same data "
                             "files (config keys 'data' and 'val_data') and tokenizer")


def _run_locked(cfg: TrainConfig, out: Path, verbose: bool = False, ranks: Ranks | None = None,
                device: torch.device | None = None) -> dict:
    # the solver (OR-Tools) only here: `slidedp export` imports this module for its checkpoint helpers
    from slidedp import api

    ranks = ranks or Ranks()
    device = device or torch.device(cfg.engine.device if cfg.engine.device != "auto"
                                    else ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = cfg.engine.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    _seed_everything(cfg.training.seed)

    decision = ranks.together(_resume_decision, cfg, out, device, precision, ranks.hosts) if ranks.writer \
        else ranks.together(lambda: None)
    decision = ranks.share(decision)  # rank 0 read the folder and verified the checkpoint; the others follow
    overwrite, resume_from, trainer_state, plan = (decision[k] for k in ("overwrite", "resume_from",
                                                                         "trainer_state", "plan"))
    # each host's first rank first: what it fills once (tokenized-data cache, converted model), the others read
    model, tokenizer, train, val = ranks.in_turns(_load_inputs, cfg, trainer_state, resume_from)
    _check_same_data(ranks, train, val)
    _log(f"[slidedp] data {cfg.data.data}: {len(train)} training rows"
         f"{f', {len(val)} validation rows' if val is not None else ''} of {cfg.training.seq_len} tokens "
         f"({'packed' if cfg.data.packing else 'padded'})")
    where = f", {ranks.world_size} ranks on {ranks.hosts} host(s)" if ranks.launched else ""
    _log(f"[slidedp] compiling for {device.type} ({precision}), budget {cfg.engine.budget}{where}"
         f"{', reusing the checkpoint plan' if plan else ''}")
    opt, training = cfg.optimizer, cfg.training
    optimizer = api.AdamW(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                          weight_decay=opt.weight_decay, no_decay_groups=opt.no_decay_groups)
    kwargs = dict(batch_size=training.batch_size, seq_len=training.seq_len, world_size=cfg.engine.world_size,
                  device=device.type, precision=precision, micro_batches=training.grad_accum,
                  max_grad_norm=opt.max_grad_norm or None, optimizer=optimizer, weights=weights_of(cfg, model),
                  host_memory=cfg.engine.host_memory or None, nonfinite=training.nonfinite,
                  link=link_rate(cfg.engine.link) if ranks.hosts > 1 else None, group_rows=training.group_rows)
    try:
        engine = api.compile(model, cfg.engine.budget, plan=plan, **kwargs)
    except ValueError as exc:
        if plan is None or "plan was made for another workload" not in str(exc):
            raise
        _log(f"[slidedp] the checkpoint's plan does not fit ({exc}): solving a new one")
        engine = api.compile(model, cfg.engine.budget, **kwargs)
    if verbose:
        _log(engine.plan.summary())
    _log(plan_brief(engine.plan, out / "plan.json"))
    try:
        # Everything has loaded: only now is the folder changed (by rank 0 alone).
        if ranks.writer:
            if overwrite:
                _log(f"[slidedp] overwrite=true: deleting the checkpoints in {out / CHECKPOINTS}")
                shutil.rmtree(out / CHECKPOINTS)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            engine.plan.save(out / "plan.json")
        ranks.barrier()
        if trainer_state is None:
            # A fresh run's generators start from the seed whatever loading the model consumed (a
            # random init draws from them); a resumed run's are the checkpoint's (read_engine_state).
            _seed_everything(cfg.training.seed)
        return _train_loop(cfg, engine, train, val, tokenizer, out, device, precision, resume_from, trainer_state,
                           ranks)
    finally:
        engine.close(keep_weights=False)  # the checkpoints hold the trained weights: no copy for the model


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class _Silent:
    """The metrics logger of a rank other than 0 under torchrun (rank 0 writes the metrics)."""

    def log(self, record: dict) -> None:
        pass

    def write(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


def _train_loop(cfg: TrainConfig, engine, train, val, tokenizer, out: Path, device: torch.device, precision: str,
                resume_from: Path | None, trainer_state: dict | None, ranks: Ranks | None = None) -> dict:
    ranks = ranks or Ranks()
    start = 0
    tokens_seen = 0
    val_loss = None
    consecutive_skips = 0  # steps skipped in a row for a non-finite gradient
    if trainer_state is not None:
        engine.load_checkpoint(resume_from, verify=False)  # verified before compiling; data position loaded
        start = int(trainer_state["step"])
        tokens_seen = int(trainer_state.get("tokens_seen", 0))
        val_loss = trainer_state.get("val_loss")
        consecutive_skips = int(trainer_state.get("consecutive_skips", 0))
        _log(f"[slidedp] resumed at step {start} (AdamW step {engine.host.step}, epoch {train.epoch})")
    if start >= cfg.training.max_steps:
        _log(f"[slidedp] the checkpoint is at step {start}, max_steps is {cfg.training.max_steps}: nothing to do")

    rows_per_step = cfg.training.batch_size * cfg.training.grad_accum * cfg.engine.world_size
    sched = dict(lr=cfg.optimizer.lr, schedule=cfg.schedule.lr_schedule, warmup_steps=cfg.schedule.warmup_steps,
                 max_steps=cfg.training.max_steps, min_lr=cfg.schedule.min_lr)
    flops = model_flops_per_step(engine.graph, rows_per_step // engine.plan.workload.batch_size)
    peak = peak_flops_per_s(engine.plan, device)
    # A preset's guess for this machine (plan_brief said so, and the hardware module warned once)
    # is kept under a name that says so and left off the per-step line.
    predicted_key = "preset_estimate_step_s" if preset_guess(engine.plan) else "predicted_step_s"
    losses: list[float] = []
    checkpoint = resume_from
    keep_last = cfg.checkpoint.keep_last

    def state_for(step: int) -> dict:
        return {
            "format": TRAINER_FORMAT, "step": step, "tokens_seen": tokens_seen, "data": train.state_dict(),
            "schedule": schedule_state(step, **sched), "val_loss": val_loss, "config": cfg.to_dict(),
            "device": device.type, "precision": precision, "consecutive_skips": consecutive_skips,
            "hosts": ranks.hosts,
        }

    if ranks.writer:
        trackers = open_trackers(parse_report_to(cfg.metrics.report_to), out, flat_keys(cfg.to_dict()),
                                 resumed=start > 0)
        logger = MetricsLogger(out, max_steps=cfg.training.max_steps, start_step=start,
                               log_every=cfg.metrics.log_every, progress=cfg.metrics.progress,
                               tensorboard=cfg.metrics.tensorboard, trackers=trackers)
    else:
        logger = _Silent()

    def stopping() -> bool:
        """Whether to stop now: a signal seen by any rank stops every rank at the same step."""
        stop.signum = ranks.any_signal(stop.signum)
        return stop.signum is not None

    step = saved_step = start
    try:
        with stop_on_signals() as stop:
            for step in range(start + 1, cfg.training.max_steps + 1):
                if stopping():  # arrived during the last checkpoint or validation
                    step -= 1
                    break
                lr = lr_at(step, **sched)
                engine.optimizer = dataclasses.replace(engine.optimizer, lr=lr)
                batch = train.next_fields(rows_per_step)
                t0 = time.perf_counter()
                try:
                    loss = engine.step(batch.input_ids, batch.labels, batch.attention_mask)
                except NonFiniteGradientError as exc:  # nonfinite = stop
                    raise NonFiniteGradientError(f"step {step}: {exc} (latest checkpoint: {checkpoint or 'none'}; "
                                                 "resume from it with other settings)") from None
                step_s = time.perf_counter() - t0
                info = engine.last_step
                mask = batch.attention_mask
                n_tokens = int(mask.sum()) if mask is not None else batch.input_ids.numel()
                tokens_seen += n_tokens
                losses.append(loss)
                record = {
                    "step": step, "loss": loss, "grad_norm": info.grad_norm, "lr": lr, "skipped": info.skipped,
                    "skipped_steps": engine.skipped_steps,
                    "clip_coef": info.clip_coef, "trained_tokens": info.tokens, "tokens_per_s": n_tokens / step_s,
                    "tflops": flops / step_s / 1e12, "mfu": flops / step_s / peak if peak else None,
                    "step_s": step_s, predicted_key: engine.plan.predicted_step_time_s, "epoch": train.epoch,
                    "device_bytes": device_memory_bytes(device), "host_rss_bytes": host_rss_bytes(),
                }
                if info.skipped:
                    consecutive_skips += 1
                    logger.write(f"[slidedp] step {step} skipped: non-finite gradient (norm {info.grad_norm}); "
                                 f"nothing was updated ({consecutive_skips} in a row, {engine.skipped_steps} in all)")
                    if cfg.training.max_skipped_steps and consecutive_skips >= cfg.training.max_skipped_steps:
                        logger.log(record)
                        raise NonFiniteGradientError(
                            f"{consecutive_skips} consecutive steps (up to step {step}) had a non-finite gradient "
                            f"(last norm {info.grad_norm}, loss {loss}) and were skipped: stopping "
                            f"(max_skipped_steps={cfg.training.max_skipped_steps}). The weights are those of step "
                            f"{step - consecutive_skips}; latest checkpoint: {checkpoint or 'none'}. Lower lr, "
                            "check the data, or use precision=fp32")
                else:
                    consecutive_skips = 0
                last = step == cfg.training.max_steps
                if val is not None and ((cfg.data.val_every and step % cfg.data.val_every == 0) or last):
                    val_loss = validation_loss(engine, val, cfg.training.batch_size * cfg.training.grad_accum)
                    record["val_loss"] = val_loss
                logger.log(record)
                if (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0) or last:
                    checkpoint = save_run_checkpoint(engine, out, step, state_for(step), tokenizer, keep_last, ranks)
                    saved_step = step
                    logger.write(f"[slidedp] checkpoint written: {checkpoint}")
                if stopping():
                    break
            if stopping() and step > start and saved_step != step:
                checkpoint = save_run_checkpoint(engine, out, step, state_for(step), tokenizer, keep_last, ranks)
                saved_step = step
                logger.write(f"[slidedp] checkpoint written: {checkpoint}")
    finally:
        logger.close()
    if stop.signum is not None and step < cfg.training.max_steps:
        name = signal.Signals(stop.signum).name
        where = (f"checkpoint {checkpoint} (step {step}); continue with resume=true" if checkpoint
                 else "no checkpoint (no step was taken)")
        raise TrainingInterrupted(f"stopped by {name} after step {step} of {cfg.training.max_steps}: {where}",
                                  signum=stop.signum, step=step, checkpoint=str(checkpoint) if checkpoint else None)
    if losses:
        _log(f"[slidedp] done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
             f"{f', validation loss {val_loss:.4f}' if val_loss is not None else ''}; checkpoint {checkpoint}; "
             f"export it with `slidedp export {checkpoint} OUT_DIR`")
    return {
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "losses": losses, "steps": len(losses), "start_step": start, "val_loss": val_loss,
        "checkpoint": str(checkpoint) if checkpoint else None,
    }
