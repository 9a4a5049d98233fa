"""A tiny Hugging Face model folder with its own tokenizer, made offline, for the train job tests."""

import json

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is two plus two?\nAnswer: four.",
    "slidedp streams layers through the accelerator while the optimizer runs on the host.",
] * 8


def make_tokenizer():
    """A byte-level BPE tokenizer of about 300 tokens, trained in milliseconds on CORPUS."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


def save_tiny_model(folder, *, vocab: int, tied: bool = True, seed: int = 0):
    """A 2-block Llama with random weights, saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A folder with config.json, model.safetensors and the tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_tokenizer.save_pretrained(folder)
    save_tiny_model(folder, vocab=len(tiny_tokenizer))
    return folder


@pytest.fixture(scope="session")
def tiny_jsonl(tmp_path_factory):
    """A prompt/completion JSONL file and a text JSONL file."""
    folder = tmp_path_factory.mktemp("data")
    pc = folder / "pairs.jsonl"
    with open(pc, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?\n",
                                "completion": f"Answer: {2 * i}.\n"}) + "\n")
    text = folder / "text.jsonl"
    with open(text, "w") as f:
        for i, line in enumerate(CORPUS):
            f.write(json.dumps({"text": f"{i}: {line}"}) + "\n")
    return pc, text
