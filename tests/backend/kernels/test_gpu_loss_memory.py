"""On a GPU (skipped without one): the fused head + loss holds what the cost model charges for it.

costmodel.memory.logit_bytes charges a fused loss chunk its fp32 logits and its dlogits in the compute
dtype (4 + 2 B a logit in bf16); streamed_epilogue_working_bytes charges a vocabulary-streamed chunk's
backward its dlogits beside one hidden-state gradient, then that gradient's fp32 copy. Measured here with
the CUDA allocator's peak over what was allocated before: within the charge, and not far under it (a
charge twice too high leaves a small budget's memory unused)."""

import pytest
import torch

from slidedp.backend.kernels.linear_cross_entropy import (
    linear_cross_entropy,
    vocab_chunk_backward,
    vocab_chunk_forward,
)
from slidedp.costmodel import memory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

T, H, V, CHUNK = 4096, 2048, 151936, 2048
E = 2  # bf16


def inputs(vocab: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    labels = torch.randint(0, vocab, (T,), device="cuda", generator=g)
    return hidden, weight, labels


def peak_over_start(fn) -> tuple[int, object]:
    """(The allocator's peak while `fn` runs over what was allocated when it started, fn's result)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, out


def test_fused_loss_chunk_holds_its_logit_bytes():
    hidden, weight, labels = inputs(V)
    acc = torch.zeros(V, H, dtype=torch.float32, device="cuda")
    linear_cross_entropy(hidden, weight, labels, chunk_tokens=CHUNK, grad_weight_acc=acc)  # compiles the kernel
    peak, _ = peak_over_start(lambda: linear_cross_entropy(hidden, weight, labels, chunk_tokens=CHUNK,
                                                           grad_weight_acc=acc))
    charged = CHUNK * V * memory.logit_bytes(E, fused=True)
    outputs = T * H * E + 2 * T * 4 + T * 4 + T * 8  # grad_hidden; lse, target; coef; valid and labels' temporaries
    # the chunk's fp32 logits and bf16 dlogits are both allocated up front; a tenth over the charge
    # allows for the GEMMs' workspaces (an fp32 temporary of the chunk's logits would be a half over)
    assert charged <= peak <= 1.1 * charged + outputs, (peak, charged)


def test_streamed_chunk_backward_holds_its_dlogits_and_one_hidden_gradient():
    rows = 12662
    hidden, weight, labels = inputs(rows)
    lse, _ = vocab_chunk_forward(hidden, weight, labels, CHUNK)
    coef = torch.full((T,), 1.0 / T, device="cuda")
    acc = torch.zeros(T, H, dtype=torch.float32, device="cuda")
    grad_w = torch.zeros(rows, H, dtype=torch.float32, device="cuda")
    vocab_chunk_backward(hidden, weight, labels, lse, coef, CHUNK, acc, grad_w)  # compiles the kernel
    peak, _ = peak_over_start(lambda: vocab_chunk_backward(hidden, weight, labels, lse, coef, CHUNK, acc, grad_w))
    # streamed_epilogue_working_bytes' chunk backward: the hidden-state gradient beside the dlogits, then its fp32 copy
    transient = T * H * E + max(CHUNK * rows * E, T * H * 4)
    assert 0.9 * transient <= peak <= transient + (1 << 20), (peak, transient)
