"""Engine.save_checkpoint / load_checkpoint / evaluate / export_hf and slidedp/run/checkpoint.py (CPU)."""

import copy
import json

import pytest
import torch

import slidedp
from slidedp.run import checkpoint as ckpt
from slidedp.run.checkpoint import CheckpointError
from tests.models import VOCAB, make_model

SEQ, BATCH = 16, 2


def compile_model(model, precision="fp32", **kw):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision=precision,
                           optimizer=slidedp.AdamW(lr=1e-3, weight_decay=0.1), max_grad_norm=1.0, **kw)


def batches(n, seed=0, rows=2 * BATCH):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(n)]


def host_arrays(engine):
    return [t.clone() for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_save_load_continues_bitwise(tmp_path, precision):
    """save at step 3, 3 more steps; a fresh engine loads step 3 and takes the same 3 steps: equal bits."""
    data = batches(6)
    a = compile_model(make_model("llama", tied=True), precision)
    for ids in data[:3]:
        a.step(ids)
    a.save_checkpoint(tmp_path / "ck")
    rng = torch.rand(3)  # the RNG state saved with the checkpoint comes back on load
    losses_a = [a.step(ids) for ids in data[3:]]
    state_a, arrays_a = a.state_dict(), host_arrays(a)

    b = compile_model(make_model("llama", tied=True, seed=7), precision)  # other initial weights
    b.load_checkpoint(tmp_path / "ck")
    assert b.host.step == 3
    assert torch.equal(torch.rand(3), rng)
    if precision == "bf16":  # the delivery copy is refreshed from the loaded master
        for layer in b.host.layers:
            assert torch.equal(layer.delivery, layer.master.to(torch.bfloat16))
    losses_b = [b.step(ids) for ids in data[3:]]
    assert losses_a == losses_b
    state_b = b.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(x, y) for x, y in zip(arrays_a, host_arrays(b)))
    a.close()
    b.close()


def test_checkpoint_files_are_safetensors_and_json_with_manifest(tmp_path):
    from safetensors import safe_open

    engine = compile_model(make_model("llama"))
    engine.step(batches(1)[0])
    folder = tmp_path / "ck"
    engine.save_checkpoint(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert all(f.endswith((".json", ".safetensors")) for f in files), files  # no pickle anywhere
    assert {"manifest.json", "engine.json", "plan.json", "rng.json", "rng.safetensors", "hf/config.json"} <= set(files)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(f for f in files if f != "manifest.json")
    # the layer files are standard safetensors, readable by the safetensors library
    with safe_open(str(folder / ckpt.layer_file(1)), framework="pt") as f:
        assert sorted(f.keys()) == ["exp_avg", "exp_avg_sq", "master"]
        assert torch.equal(f.get_tensor("master"), engine.host.layers[1].master)
        assert torch.equal(f.get_tensor("exp_avg_sq"), engine.host.layers[1].exp_avg_sq)
    with safe_open(str(folder / "rng.safetensors"), framework="pt") as f:
        assert f.get_tensor("torch").dtype == torch.uint8
    assert slidedp.Plan.load(folder / "plan.json") == engine.plan
    assert json.loads((folder / "engine.json").read_text())["step"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    engine.close()


def test_truncated_or_altered_files_are_refused_by_name(tmp_path):
    engine = compile_model(make_model("llama"))
    engine.step(batches(1)[0])
    folder = tmp_path / "ck"
    engine.save_checkpoint(folder)
    before = host_arrays(engine)

    layer = folder / ckpt.layer_file(2)
    data = layer.read_bytes()
    layer.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"state/layer-00002.safetensors has \d+ bytes.*truncated"):
        engine.load_checkpoint(folder)
    layer.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"state/layer-00002.safetensors does not match its sha256"):
        engine.load_checkpoint(folder)
    assert all(torch.equal(x, y) for x, y in zip(before, host_arrays(engine)))  # nothing was changed
    layer.write_bytes(data)
    (folder / "rng.json").unlink()
    with pytest.raises(CheckpointError, match="rng.json is missing"):
        engine.load_checkpoint(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        engine.load_checkpoint(folder)
    engine.close()


def test_other_model_is_refused(tmp_path):
    engine = compile_model(make_model("llama"))
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    other = compile_model(make_model("qwen2"))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        other.load_checkpoint(tmp_path / "ck")
    other.close()


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that fails half-way leaves the previous checkpoint intact and no temporary folder."""
    engine = compile_model(make_model("llama"))
    folder = tmp_path / "ck"
    engine.save_checkpoint(folder)
    manifest = (folder / "manifest.json").read_text()
    engine.step(batches(1)[0])
    real = ckpt.write_safetensors
    calls = []

    def failing(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(path, tensors, metadata)

    monkeypatch.setattr(ckpt, "write_safetensors", failing)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(folder)
    assert (folder / "manifest.json").read_text() == manifest
    ckpt.verify_checkpoint(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    monkeypatch.setattr(ckpt, "write_safetensors", real)
    engine.save_checkpoint(folder)  # replaces the old one
    assert json.loads((folder / "engine.json").read_text())["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    engine.close()


def test_evaluate_is_the_step_loss_and_changes_nothing():
    from slidedp.ir.blocks import logits_of

    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    engine = compile_model(model, micro_batches=2)
    ids = batches(1)[0]
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    before = host_arrays(engine)
    loss = engine.evaluate(ids, labels)
    assert all(torch.equal(x, y) for x, y in zip(before, host_arrays(engine)))
    assert engine.host.step == 0
    with torch.no_grad():
        logits = logits_of(ref(ids)).float()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert engine.evaluate(ids, labels, mask) == loss
    assert engine.step(ids, labels) == loss  # the loss the step reports, before its update
    # any number of rows (3: filled up to the micro-batch with rows that carry no label)
    ref.load_state_dict(engine.state_dict())  # the weights after that step's update
    with torch.no_grad():
        logits = logits_of(ref(ids[:3])).float()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:3, 1:].reshape(-1))
    assert engine.evaluate(ids[:3]) == pytest.approx(expected.item(), rel=1e-5)
    engine.close()


def test_export_hf_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    engine = compile_model(make_model("qwen3", tied=True))
    for ids in batches(2):
        engine.step(ids)
    state = engine.state_dict()
    engine.export_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, state[name]), name
    out = loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    engine.close()
    plain = compile_model(make_model("plain"))
    with pytest.raises(TypeError, match="not a Hugging Face model"):
        plain.export_hf(tmp_path / "plain")
    plain.close()


def test_read_master_weights_from_checkpoint_alone(tmp_path):
    engine = compile_model(make_model("llama", tied=True))
    engine.step(batches(1)[0])
    engine.save_checkpoint(tmp_path / "ck")
    state = engine.state_dict()
    engine.close()
    weights = ckpt.read_master_weights(tmp_path / "ck")
    assert sorted(weights) == sorted(state)
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_safetensors_writer_round_trip(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
               "empty": torch.empty(0), "u8": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    sha = ckpt.write_safetensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    assert sha == ckpt._sha256_file(tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    dst = torch.empty(3, 5)
    ckpt.read_safetensors_into(tmp_path / "x.safetensors", {"a": dst})
    assert torch.equal(dst, tensors["a"])
    with pytest.raises(CheckpointError, match="expected"):
        ckpt.read_safetensors_into(tmp_path / "x.safetensors", {"a": torch.empty(4)})


def test_export_hf_writes_the_tokenizer_in_the_dtype_asked_readable_by_others(tmp_path):
    import os
    import stat

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.train.conftest import make_tokenizer

    tok = make_tokenizer()
    engine = compile_model(make_model("llama", tied=True))
    engine.step(batches(1)[0])
    state = engine.state_dict()
    engine.export_hf(tmp_path / "fp32", tokenizer=tok)  # the engine's precision: fp32
    engine.export_hf(tmp_path / "bf16", dtype="bf16")
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        engine.export_hf(tmp_path / "fp8", dtype="fp8")
    engine.close()
    assert AutoTokenizer.from_pretrained(tmp_path / "fp32")("def add").input_ids == tok("def add").input_ids
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, p in half.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, state[name].bfloat16()), name
    for name, p in exact.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, state[name]), name
    umask = os.umask(0)
    os.umask(umask)
    for f in [*(tmp_path / "fp32").iterdir(), *(tmp_path / "bf16").iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
