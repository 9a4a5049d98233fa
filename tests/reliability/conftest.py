"""Fixtures of the reliability tests: the tiny model folder and data of tests/train, a config
builder, and a runner for `slidedp train` in a subprocess (tests/reliability/faulty_train.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.conftest import CORPUS, make_tokenizer, save_tiny_model

REPO = Path(__file__).resolve().parents[2]
FAULTY_TRAIN = Path(__file__).with_name("faulty_train.py")


@pytest.fixture(scope="session")
def rel_model_dir(tmp_path_factory):
    """A 2-block Llama (hidden 32) with a ~300-token BPE tokenizer, saved as safetensors."""
    folder = tmp_path_factory.mktemp("rel-tiny-llama")
    tok = make_tokenizer()
    tok.save_pretrained(folder)
    save_tiny_model(folder, vocab=len(tok))
    return folder


@pytest.fixture(scope="session")
def rel_data(tmp_path_factory):
    """A text JSONL file of 32 short documents."""
    path = tmp_path_factory.mktemp("rel-data") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}: {line}"}) + "\n" for i, line in enumerate(CORPUS)))
    return path


def overrides(model_dir, data, out, *extra) -> list[str]:
    """key=value overrides of a tiny CPU fp32 run (constant lr, checkpoints every 2 steps)."""
    return [f"model={model_dir}", f"data={data}", f"output_dir={out}", "max_steps=6", "batch_size=2",
            "seq_len=32", "lr=5e-3", "warmup_steps=2", "weight_decay=0.1", "max_grad_norm=1.0",
            "save_every=2", "keep_last=3", "precision=fp32", "device=cpu", "progress=false",
            "tensorboard=false", *extra]


def subprocess_env(**extra) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_train(args: list[str], **env) -> subprocess.Popen:
    """`slidedp train ARGS` in a subprocess, through faulty_train.py (faults chosen by env)."""
    return subprocess.Popen([sys.executable, str(FAULTY_TRAIN), "train", *args], env=subprocess_env(**env),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
