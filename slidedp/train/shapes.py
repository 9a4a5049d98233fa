"""Preset model shapes (random init), by name: for planning and benchmarks without downloads."""

from __future__ import annotations

from pathlib import Path

# name: (config class, hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied)
PRESETS = {
    "qwen3-0.6b": ("Qwen3Config", 1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": ("Qwen3Config", 2048, 6144, 28, 16, 8, 128, 151936, True),  # tied, as released
    "qwen3-4b": ("Qwen3Config", 2560, 9728, 36, 32, 8, 128, 151936, False),
    "qwen3-8b": ("Qwen3Config", 4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen3-14b": ("Qwen3Config", 5120, 17408, 40, 40, 8, 128, 151936, False),
    "qwen3-32b": ("Qwen3Config", 5120, 25600, 64, 64, 8, 128, 151936, False),
    "llama3.2-3b": ("LlamaConfig", 3072, 8192, 28, 24, 8, 128, 128256, True),  # tied, as released
    "llama3-8b": ("LlamaConfig", 4096, 14336, 32, 32, 8, 128, 128256, False),
    "llama3-70b": ("LlamaConfig", 8192, 28672, 80, 64, 8, 128, 128256, False),
    "qwen2.5-72b": ("Qwen2Config", 8192, 29568, 80, 64, 8, 128, 152064, False),
    # a few million parameters, the SmolLM2 vocabulary: try `slidedp train` end to end in seconds
    "llama-tiny": ("LlamaConfig", 64, 256, 2, 4, 2, 16, 49152, True),
}


def refuse_hub_id(spec: str, what: str = "model") -> None:
    """A Hugging Face Hub id (`Qwen/Qwen3-4B`: one slash, no such folder here) is refused with how to
    get the folder: slidedp reads local folders only and assumes no network access."""
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and all(spec.split("/")) \
            and not Path(spec).exists():
        raise FileNotFoundError(
            f"{what}: {spec} looks like a Hugging Face Hub id, but slidedp reads local folders only (no "
            f"download): fetch the model first, e.g. `huggingface-cli download {spec} --local-dir "
            f"{spec.split('/')[1]}` on a machine with network access, and give that folder")


def preset_config(name: str):
    """The transformers config of a preset shape; a clear error lists the presets."""
    refuse_hub_id(name)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: a local Hugging Face folder or one of {', '.join(PRESETS)}")
    import transformers  # only when a preset is built: the command line lists PRESETS without it

    cls, hidden, inter, layers, heads, kv, head_dim, vocab, tied = PRESETS[name]
    return getattr(transformers, cls)(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=40960,
    )
