"""More Hugging Face causal-LM families, each trained beside torch.optim.AdamW (three steps of two
micro-batches with clipping, fp32 on the CPU): the tracer, the blocks' calls and the head found in each."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side
from tests.models import VOCAB

_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)

# family: (model class, config class, config arguments besides _SIZES, or in place of them)
FAMILIES = {
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_SIZES, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_SIZES, head_dim=8, sliding_window=8)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(_SIZES, head_dim=8, sliding_window=8)),
    "phi": ("PhiForCausalLM", "PhiConfig", _SIZES),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_SIZES, pad_token_id=0)),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", dict(_SIZES, pad_token_id=0)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", _SIZES),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", _SIZES),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", _SIZES),
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(_SIZES, pad_token_id=0)),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", _SIZES),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                                          num_attention_heads=4)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                                num_attention_heads=4, max_position_embeddings=128,
                                                word_embed_proj_dim=32)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=128,
                                                   rotary_dim=4)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_as_torch_adamw_trains_it(family):
    model_name, config_name, kwargs = FAMILIES[family]
    if not (hasattr(transformers, model_name) and hasattr(transformers, config_name)):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).float()
    ref = copy.deepcopy(model).eval()  # slidedp trains without dropout (OPT's default config has some)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, micro_batches=2)
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=1)


def test_a_model_with_dropout_is_told_it_trains_without(caplog):
    """OPT's default config drops 10% of activations; slidedp runs every block in eval mode (a recomputed
    forward must be the forward it replaces) and says so once, naming where the model had dropout; a model
    without any says nothing."""
    model_name, config_name, kwargs = FAMILIES["opt"]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs, dropout=0.1)).float()
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    plain.config.dropout = 0.0
    with caplog.at_level("WARNING", logger="slidedp"):
        slidedp.compile(plain, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32").close()
        assert not [r for r in caplog.records if "dropout" in r.getMessage()]
        slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32").close()
    (said,) = [r.getMessage() for r in caplog.records if "dropout" in r.getMessage()]
    assert "training without dropout" in said and "config.dropout=0.1" in said
    assert not model.training  # what it says: the blocks run in eval mode


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "opt"])
def test_logits_changed_after_the_head_keep_it_resident_and_whole(family):
    """Gemma-2 soft-caps its logits, Cohere and Granite scale them, OPT copies them (.contiguous()): the head's
    output is not the logits, so the loss cannot be fused nor the head stream by vocabulary chunk. The IR says
    so, the plan at the smallest budget keeps the head resident and charges the micro-batch's whole logits,
    and it trains as torch.optim.AdamW trains the model."""
    from slidedp.errors import InfeasibleBudgetError

    model_name, config_name, kwargs = FAMILIES[family]
    if not (hasattr(transformers, model_name) and hasattr(transformers, config_name)):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).float()
    ref = copy.deepcopy(model).eval()
    workload = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", micro_batches=2)
    with pytest.raises(InfeasibleBudgetError) as info:
        slidedp.plan(model, 1000, **workload)
    plan = slidedp.plan(model, info.value.min_budget_bytes, **workload)
    assert plan.decisions[-1].activation != "streamed" and plan.loss_chunk_tokens == BATCH * SEQ
    assert "loss computed by the model's own forward on a micro-batch's whole logits" in plan.summary()
    engine = slidedp.compile(model, info.value.min_budget_bytes, plan=plan, max_grad_norm=CLIP,
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), **workload)
    assert not engine.graph.linear_head
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=5)
