"""The model and data every system trains: a Qwen3 (or Llama) shape with seeded, bf16-rounded random
init, and seeded random batches (identical in every system and every process)."""

from __future__ import annotations

import zlib

LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-5, (0.9, 0.999), 1e-8, 0.0, 1.0
INIT_STD = 0.02

SHAPES = {
    # Qwen3-4B: 4,411,424,256 parameters (untied embedding and head)
    "4b": dict(hidden=2560, intermediate=9728, blocks=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
               seq=4096),
    # Qwen3-8B: 8,190,735,360 parameters (untied); its host state (16 bytes per parameter) is 122 GiB
    "8b": dict(hidden=4096, intermediate=12288, blocks=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
               seq=4096),
    # Qwen3-14B: 14,768,307,200 parameters (untied, as the model is); its host state alone does not fit
    # the one-H200 machine's RAM at 16 bytes per parameter
    "14b": dict(hidden=5120, intermediate=17408, blocks=40, heads=40, kv_heads=8, head_dim=128, vocab=151936,
                seq=4096),
    # Llama-3.2-3B: 3,606,752,256 parameters with its head untied (the model ties it; untied here, as
    # the Qwen3 shapes are); held out from every fit of the cost model's coefficients
    "llama3b": dict(hidden=3072, intermediate=8192, blocks=28, heads=24, kv_heads=8, head_dim=128, vocab=128256,
                    seq=4096, family="llama"),
    # Llama-3.1-8B: 8,030,261,248 parameters (untied, as the model is); held out from every fit
    "llama8b": dict(hidden=4096, intermediate=14336, blocks=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                    seq=4096, family="llama"),
    # Qwen3-1.7B: 2,031,739,904 parameters with its head untied (the model ties it; untied here, as the
    # other shapes are); held out from every fit
    "1.7b": dict(hidden=2048, intermediate=6144, blocks=28, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                 seq=4096),
    # CPU smoke test
    "tiny": dict(hidden=64, intermediate=128, blocks=2, heads=4, kv_heads=2, head_dim=16, vocab=512, seq=32),
}


# -- model and data: identical in every system --------------------------------------------------------

def qwen3_config(shape: str):
    """The transformers config of `shape` (a Qwen3Config, or a LlamaConfig for the Llama shapes)."""
    from transformers import LlamaConfig, Qwen3Config

    s = SHAPES[shape]
    config_class = LlamaConfig if s.get("family") == "llama" else Qwen3Config
    cfg = config_class(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["blocks"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      vocab_size=s["vocab"], tie_word_embeddings=False, use_cache=False,
                      max_position_embeddings=max(s["seq"], 1 << 18))  # default RoPE: a bound only
    cfg._attn_implementation = "sdpa"  # the same attention kernels in every system
    return cfg


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def empty_model(shape: str, *, dtype, device):
    """The causal LM of `shape` (Qwen3ForCausalLM or LlamaForCausalLM), its parameters (of `dtype`) on the
    meta device, its rotary buffers (fp32 inverse frequencies, computed on the CPU) on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = qwen3_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    rotary = model.model.rotary_emb
    fresh = type(rotary)(config=cfg)
    for bname, buf in fresh.named_buffers(recurse=False):
        rotary._buffers[bname] = buf.to(device)
    return model


def plan_graph_of(plan, shape: str, *, device: str = "meta"):
    """The layer graph of `plan` on an empty model of `shape` in the plan's precision (slidedp.api.plan_graph),
    its rotary buffers on `device`: what a replay or a lowering of a saved plan needs, no weights."""
    import torch

    import slidedp.api

    dtype = torch.bfloat16 if plan.workload.precision == "bf16" else torch.float32
    return slidedp.api.plan_graph(empty_model(shape, dtype=dtype, device=device), plan)


def init_value(name: str, shape, *, init_device, seed: int):
    """Parameter `name`'s initial value, bf16 on `init_device`: ones for RMSNorm weights (1-D; Qwen3 has
    no biases), else N(0, INIT_STD) from its own seeded generator, rounded to bf16."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16, device=init_device)
    gen = torch.Generator(device=init_device).manual_seed(param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32, device=init_device)
    value.normal_(0.0, INIT_STD, generator=gen)
    return value.to(torch.bfloat16)


def build_model(shape: str, *, dtype, device, init_device, seed: int):
    """The causal LM of `shape` with parameters of `dtype` on `device`, initialised on `init_device`
    from one seeded generator per parameter and rounded to bf16 (see the module docstring)."""
    from torch import nn

    model = empty_model(shape, dtype=dtype, device=device)
    named = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            value = init_value(named[id(p)], tuple(p.shape), init_device=init_device, seed=seed)
            module._parameters[pname] = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=True)
            del value
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left}")
    return model


def batches(vocab: int, rows: int, seq: int, n: int, seed: int):
    import torch

    return [torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed * 7919 + 1 + i))
            for i in range(n)]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def fewest_checkpointed(n_blocks: int, fits) -> tuple[int, list[int]]:
    """The fewest leading blocks to checkpoint, k in 0..n_blocks, with which `fits(k)` (a training
    step with blocks 0..k-1 checkpointed runs within the device's memory) holds: a binary search on
    k (memory falls as k grows), n_blocks when nothing smaller fits. Returns k and every k tried."""
    tried = []
    lo, hi = 0, n_blocks  # fits(hi) is assumed: every block checkpointed is the least memory
    while lo < hi:
        mid = (lo + hi) // 2
        tried.append(mid)
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, tried


def checkpoint_leading_blocks(model, k: int) -> None:
    """Activation checkpointing (non-reentrant) on decoder blocks 0..k-1 only: the others keep their
    activations from forward to backward."""
    enable_checkpointing(model)
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = i < k


def enable_checkpointing(model) -> str:
    """Non-reentrant activation checkpointing of every decoder block, with whichever entry point this
    transformers has; returns which one was used. Checks that every block has it on."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        how = "activation_checkpointing_enable(use_reentrant=False)"
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        how = "gradient_checkpointing_enable(use_reentrant=False)"
    off = [i for i, layer in enumerate(model.model.layers) if not getattr(layer, "gradient_checkpointing", False)]
    if off:
        raise RuntimeError(f"activation checkpointing is off in blocks {off}")
    return how


