"""On a GPU (skipped without one): recompute_offload trains bit for bit as recompute (the block's input
goes to pinned host memory and comes back unchanged) and takes less device memory at the peak (the
inputs of the blocks in between are off the device)."""

import dataclasses
import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slidedp
from slidedp.scheduler.problem.lanes import window_loads
from tests.models import VOCAB

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCKS, SEQ, MICRO_BATCHES, STEPS = 8, 512, 4, 3


def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=BLOCKS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    config._attn_implementation = "eager"  # matmuls and softmax: a deterministic backward
    return LlamaForCausalLM(config)


def train(policies: list[str]):
    """STEPS fp32 steps of a fresh model under `policies`: the losses, the weights and the peak device bytes."""
    model = make_model()
    kwargs = dict(batch_size=1, seq_len=SEQ, device="cuda", precision="fp32", micro_batches=MICRO_BATCHES,
                  compile_blocks=False)
    plan = slidedp.plan(model, "4GiB", **kwargs)
    it = iter(policies)
    plan = plan.replace(decisions=tuple(dataclasses.replace(d, activation=next(it)) if d.kind == "block" else d
                                        for d in plan.decisions),
                        window=2, window_loads=window_loads(BLOCKS, 2))
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine = slidedp.compile(model, "4GiB", optimizer=slidedp.AdamW(lr=1e-3), max_grad_norm=1.0, plan=plan, **kwargs)
    gen = torch.Generator().manual_seed(3)
    losses = [engine.step(torch.randint(0, VOCAB, (MICRO_BATCHES, SEQ), generator=gen)) for _ in range(STEPS)]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    offloaded = engine.executor.offloaded_bytes
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return losses, state, peak, offloaded


def test_recompute_offload_is_recompute_bit_for_bit_in_less_device_memory():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        recompute = train(["recompute"] * BLOCKS)
        again = train(["recompute"] * BLOCKS)
        offload = train(["recompute"] + ["recompute_offload"] * (BLOCKS - 1))
    finally:
        torch.use_deterministic_algorithms(False)
    assert again[0] == recompute[0] and all(torch.equal(again[1][k], v) for k, v in recompute[1].items()), \
        "two runs of the same plan differ: the comparison below needs a deterministic backward"
    assert offload[0] == recompute[0]
    assert all(torch.equal(offload[1][k], v) for k, v in recompute[1].items())
    assert offload[3] > 0 and recompute[3] == 0
    # blocks 2 .. BLOCKS-1's inputs (MICRO_BATCHES x SEQ x 256 fp32 each) are off the device at the peak
    assert offload[2] < recompute[2], (offload[2], recompute[2])
