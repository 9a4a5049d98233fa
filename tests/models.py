"""Tiny models of every supported family, shared by the tests (random weights, no hub)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

VOCAB = 96


class PlainBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        # no in-projection bias: its key part has a zero gradient, which AdamW turns into noise
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True, bias=False)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        seq = x.shape[1]
        causal = torch.triu(torch.full((seq, seq), float("-inf"), device=x.device, dtype=x.dtype), 1)
        h = self.norm(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.ff(x)


class PlainLM(nn.Module):
    """A hand-written transformer: blocks under a non-standard name, embedding scaling in forward."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, n_blocks: int = 3, tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.trunk = nn.ModuleList(PlainBlock(dim) for _ in range(n_blocks))
        self.final = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.out.weight = self.tok.weight

    def forward(self, input_ids):
        x = self.tok(input_ids) * (self.tok.embedding_dim ** 0.5)
        for block in self.trunk:
            x = block(x)
        return self.out(self.final(x))


def _common(tied: bool) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                max_position_embeddings=128)


def make_model(family: str, tied: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_common(tied)))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_common(tied)))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**_common(tied), head_dim=8))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**_common(tied), sliding_window=8))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied))
    elif family == "plain":
        model = PlainLM(tied=tied)
    else:
        raise ValueError(family)
    return model.float()


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gpt2", "plain"]
