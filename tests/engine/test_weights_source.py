"""compile(weights=...): a model built with its parameters on the meta device, its weights read
straight into the host state from a safetensors checkpoint (sharded) or a function, trains exactly
as the same model built with its weights; what cannot be loaded is refused before anything runs."""

import copy

import accelerate
import pytest
import torch
from safetensors.torch import save_file

import slidedp
from slidedp.errors import UnsupportedModelError
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side
from tests.models import make_model


def empty_like(model):
    """The same architecture with its parameters on the meta device (buffers real)."""
    with accelerate.init_empty_weights():
        return type(model)(model.config)


def compiled(model, **kw):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, **kw)


@pytest.mark.parametrize("family, tied", [("llama", True), ("qwen3", False), ("gpt2", True)])
def test_checkpoint_folder_into_a_meta_model_trains_exactly(family, tied, tmp_path):
    source = make_model(family, tied=tied)
    source.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded: every file is read
    ref = copy.deepcopy(source).eval()
    model = empty_like(source)
    assert all(p.device.type == "meta" for p in model.parameters())
    with compiled(model, weights=tmp_path) as engine:
        if tied:  # one parameter object under both names, as the model had it
            embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
            assert embed is head and embed.device.type == "cpu"
        train_side_by_side(engine, ref, steps=2, seed=5)


def test_function_fills_each_master():
    source = make_model("qwen3")
    values = {name: p.detach().clone() for name, p in source.named_parameters()}
    seen = []

    def fill(name, out):
        assert out.dtype == torch.float32 and out.shape == values[name].shape
        seen.append(name)
        out.copy_(values[name])

    ref = copy.deepcopy(source).eval()
    with compiled(empty_like(source), weights=fill) as engine:
        assert sorted(seen) == sorted(values)
        train_side_by_side(engine, ref, steps=2, seed=6)


def test_what_cannot_be_loaded_is_refused(tmp_path):
    source = make_model("llama")
    with pytest.raises(UnsupportedModelError, match="weights="):  # meta parameters and nothing to load them from
        compiled(empty_like(source))
    with torch.device("meta"):  # buffers on the meta device too: no checkpoint holds them
        all_meta = type(source)(source.config)
    with pytest.raises(UnsupportedModelError, match="init_empty_weights"):
        compiled(all_meta, weights=tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        compiled(empty_like(source), weights=tmp_path / "nowhere")
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    partial = dict(state)
    partial.pop("model.layers.1.mlp.up_proj.weight")
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        compiled(empty_like(source), weights=tmp_path / "partial.safetensors")
    wrong = dict(state, **{"lm_head.weight": torch.zeros(3, 3)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        compiled(empty_like(source), weights=tmp_path / "wrong.safetensors")
