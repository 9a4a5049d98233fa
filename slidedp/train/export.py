"""`slidedp export CHECKPOINT OUT_DIR`: a Hugging Face folder from a checkpoint alone.

The checkpoint carries everything: the master weights and their layout (`engine.json`, the layer
files), the model's config and generation config and, for checkpoints of `slidedp train`, the
tokenizer (`hf/`). The model is built from the config on the meta device (nothing allocated),
the master weights are saved through its `save_pretrained`, and the tokenizer files are copied,
so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer.from_pretrained(OUT_DIR)`
load the fine-tuned model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from slidedp.run.checkpoint import (
    HF_DIR, MANIFEST, CheckpointError, hf_skeleton, read_engine_meta, read_master_weights, save_hf, usual_permissions,
    verify_checkpoint,
)
from slidedp.train.job import list_checkpoints, newest_usable_checkpoint
from slidedp.train.runlock import is_run_folder, run_folder_lock, run_folder_of


def _is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder as given (verified), or the newest checkpoint of a run's output_dir that
    verifies (each newer one skipped is named on stderr)."""
    path = Path(path)
    if _is_checkpoint(path):
        verify_checkpoint(path)
        return path
    if list_checkpoints(path):
        return newest_usable_checkpoint(path, verify_checkpoint, what="exporting")[0]
    raise CheckpointError(f"{path} is neither a slidedp checkpoint (no {MANIFEST}) nor a run folder with "
                          "complete checkpoints")


def check_export_target(out: Path, *, overwrite: bool) -> None:
    """Refuse a target that is (or lies inside) a run folder or a checkpoint folder, and a
    non-empty target unless `overwrite`."""
    resolved = out.resolve()
    for folder in (resolved, *resolved.parents):
        if _is_checkpoint(folder):
            raise ValueError(f"export target {out} is {'' if folder == resolved else 'inside '}the checkpoint "
                             f"folder {folder}: writing there would break the checkpoint; choose a folder outside it")
        if is_run_folder(folder):
            raise ValueError(f"export target {out} is {'' if folder == resolved else 'inside '}the run folder "
                             f"{folder}: writing there would mix with (or overwrite) the run's files; choose a "
                             "folder outside it")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"export target {out} exists and is not a folder")
        if any(out.iterdir()) and not overwrite:
            raise ValueError(f"export target {out} is not empty: pass --overwrite (overwrite=True) to replace "
                             "it, or choose another folder")


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                      dtype: str = "bf16") -> tuple[Path, int]:
    """Write the Hugging Face folder `out` from a checkpoint (or a run's newest usable one), its
    weights in `dtype` ("bf16", as the model was trained to run, or "fp32", the master weights
    exactly); returns (checkpoint, step). The files are readable by others (0666 less the umask).

    The source's run folder is locked while it is read (runlock.py). The folder is written into a
    temporary sibling and renamed into place at the end: a failed or killed export leaves `out`
    as it was (an existing one is replaced only with `overwrite`)."""
    src, out = Path(src), Path(out)
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"export dtype must be 'bf16' or 'fp32', got {dtype!r}")
    check_export_target(out, overwrite=overwrite)
    run_dir = run_folder_of(src)
    with run_folder_lock(run_dir, what="slidedp export") if run_dir is not None else contextlib.nullcontext():
        folder = resolve_checkpoint(src)
        hf = folder / HF_DIR
        if not (hf / "config.json").is_file():
            raise CheckpointError(f"checkpoint {folder} has no {HF_DIR}/config.json: its model is not a Hugging "
                                  "Face model, so it cannot be exported as one")
        step = int(read_engine_meta(folder)["step"])
        model = hf_skeleton(AutoConfig.from_pretrained(hf))
        if (hf / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(hf)
        parent = out.absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            save_hf(model, read_master_weights(folder), tmp, dtype=dtype)
            for f in sorted(hf.iterdir()):
                if f.is_file() and f.name not in ("config.json", "generation_config.json"):
                    shutil.copy2(f, tmp / f.name)
            usual_permissions(tmp)
            _replace_folder(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder, step


def _replace_folder(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` (checked by the caller) is moved aside first and
    deleted once the new folder is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.absolute().parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
