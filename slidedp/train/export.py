"""`slidedp export CHECKPOINT OUT_DIR`: a Hugging Face folder from a checkpoint alone.

The checkpoint carries everything: the master weights and their layout (`engine.json`, the layer
files), the model's config and generation config and, for checkpoints of `slidedp train`, the
tokenizer (`hf/`). The model is built from the config on the meta device (nothing allocated),
the master weights are saved through its `save_pretrained`, and the tokenizer files are copied,
so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer.from_pretrained(OUT_DIR)`
load the fine-tuned model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from slidedp.run.checkpoint import (
    HF_DIR, MANIFEST, CheckpointError, hf_skeleton, read_engine_meta, read_master_weights, save_hf, verify_checkpoint,
)
from slidedp.train.job import list_checkpoints


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run's output_dir."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1][1]
    raise CheckpointError(f"{path} is neither a slidedp checkpoint (no {MANIFEST}) nor a run folder with "
                          "complete checkpoints")


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, int]:
    """Write the Hugging Face folder `out` from a checkpoint (or a run's latest); returns (checkpoint, step)."""
    folder = resolve_checkpoint(src)
    verify_checkpoint(folder)
    hf = folder / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"checkpoint {folder} has no {HF_DIR}/config.json: its model is not a Hugging Face "
                              "model, so it cannot be exported as one")
    model = hf_skeleton(AutoConfig.from_pretrained(hf))
    if (hf / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf)
    out = Path(out)
    save_hf(model, read_master_weights(folder), out)
    for f in sorted(hf.iterdir()):
        if f.is_file() and f.name not in ("config.json", "generation_config.json"):
            shutil.copy2(f, out / f.name)
    return folder, int(read_engine_meta(folder)["step"])
