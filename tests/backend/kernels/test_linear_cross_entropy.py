"""Fused linear + cross-entropy (Triton in the interpreter, and the reference) against F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

import slidedp.backend.kernels.linear_cross_entropy as lce  # noqa: E402  (the module, not the function)
from slidedp.backend.kernels.linear_cross_entropy import (
    LinearCrossEntropy,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    next_token_labels,
)


def ground_truth(hidden, weight, labels, scale=1.0):
    """Full fp32 logits, F.cross_entropy(sum) and autograd: what the kernels must reproduce."""
    h = hidden.detach().float().requires_grad_(True)
    w = weight.detach().float().requires_grad_(True)
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum") * scale
    loss.backward()
    return loss.detach(), h.grad, w.grad


def close(actual, expected, rtol=2e-5):
    """Elementwise, with an absolute floor relative to the largest expected value."""
    atol = rtol * max(float(expected.abs().max()), 1e-30)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def problem(T, H, V, *, hidden_std=1.0, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * hidden_std).to(dtype).to(device)
    weight = (torch.randn(V, H, generator=g) * H**-0.5).to(dtype).to(device)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.2] = -100
    return hidden, weight, labels.to(device)


# T, H, V deliberately not multiples of the 64 x 128 x 64 tiles; V = 300 gives the forward two
# vocab splits (two tiles, then a partial one), so the streaming logsumexp and the merge both run.
CASES = {
    # chunk_tokens 70: chunks of 70, 70, 10 tokens; the second has only -100 labels
    "ragged": dict(T=150, H=80, V=300, chunk=70, scale=0.37, all_ignored=(70, 140)),
    "large_logits": dict(T=37, H=40, V=300, chunk=None, scale=1.0, hidden_std=300.0),  # logits ~ 1e2..1e3
    "tiny": dict(T=5, H=20, V=50, chunk=2, scale=2.0),  # V < BLOCK_V, H < BLOCK_H
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_cross_entropy(path, spy, case):
    c = CASES[case]
    hidden, weight, labels = problem(c["T"], c["H"], c["V"], hidden_std=c.get("hidden_std", 1.0))
    if "all_ignored" in c:
        labels[slice(*c["all_ignored"])] = -100
    fused = spy(lce, "_fused_triton")
    got = linear_cross_entropy(hidden, weight, labels, scale=c["scale"], chunk_tokens=c["chunk"])
    assert bool(fused) == (path == "interpret")

    loss, gh, gw = ground_truth(hidden, weight, labels, c["scale"])
    assert got.loss.dtype == torch.float32 and got.loss.dim() == 0
    assert got.grad_hidden.dtype == hidden.dtype and got.grad_weight.dtype == torch.float32
    close(got.loss, loss)
    close(got.grad_hidden, gh)
    close(got.grad_weight, gw)
    if "all_ignored" in c:
        assert torch.all(got.grad_hidden[slice(*c["all_ignored"])] == 0)

    ref = linear_cross_entropy_reference(hidden, weight, labels, scale=c["scale"], chunk_tokens=c["chunk"])
    close(got.loss, ref.loss)
    close(got.grad_hidden, ref.grad_hidden)
    close(got.grad_weight, ref.grad_weight)


def test_all_labels_ignored(path):
    hidden, weight, labels = problem(20, 24, 70)
    labels[:] = -100
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    assert float(got.loss) == 0.0
    assert torch.all(got.grad_hidden == 0) and torch.all(got.grad_weight == 0)


@pytest.mark.parametrize("weight_grad", [True, False])
def test_autograd_function(path, weight_grad):
    hidden, weight, labels = problem(45, 36, 150, seed=1)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(weight_grad)
    loss = LinearCrossEntropy.apply(h, w, labels, 0.5, 16)
    (loss * 2.5).backward()  # the upstream gradient multiplies the scaled one

    ref_loss, gh, gw = ground_truth(hidden, weight, labels, 0.5 * 2.5)
    close(loss * 2.5, ref_loss)
    close(h.grad, gh)
    if weight_grad:
        assert w.grad.dtype == weight.dtype
        close(w.grad, gw)
    else:
        assert w.grad is None


def test_grad_weight_accumulates_into_buffer(path):
    hidden, weight, labels = problem(40, 33, 140, seed=2)
    acc = torch.randn(140, 33)
    before = acc.clone()
    got = linear_cross_entropy(hidden, weight, labels, scale=0.1, grad_weight_acc=acc)
    assert got.grad_weight is acc
    close(acc - before, ground_truth(hidden, weight, labels, 0.1)[2], rtol=1e-4)


def test_token_weighted_executor_loss(path):
    """The executor's epilogue loss: shifted cross-entropy summed over rows, / global tokens."""
    B, S, H, V = 3, 9, 24, 90
    hidden, weight, _ = problem(B * S, H, V, seed=3)
    labels = torch.randint(0, V, (B, S))
    labels[0, :4] = -100
    global_tokens = 50
    got = linear_cross_entropy(hidden, weight, next_token_labels(labels), scale=1 / global_tokens)

    h = hidden.view(B, S, H).clone().requires_grad_(True)
    logits = h @ weight.T
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100,
                           reduction="sum") / global_tokens
    loss.backward()
    close(got.loss, loss.detach())
    close(got.grad_hidden.view(B, S, H), h.grad)
    assert torch.all(got.grad_hidden.view(B, S, H)[:, -1] == 0)  # the last position has no label


# ------------------------------------------------------------------------------------------
# the reference alone (runs without Triton)


def test_reference_bf16_inputs_compute_in_fp32(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, labels = problem(50, 40, 130, dtype=torch.bfloat16, seed=4)
    got = linear_cross_entropy(hidden, weight, labels, scale=0.3, chunk_tokens=17)
    loss, gh, gw = ground_truth(hidden, weight, labels, 0.3)  # fp32 math on the bf16 values
    close(got.loss, loss)
    close(got.grad_weight, gw)
    assert got.grad_hidden.dtype == torch.bfloat16
    # fp32 sums rounded once to bf16: within one bf16 unit of the rounded ground truth
    torch.testing.assert_close(got.grad_hidden.float(), gh, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_reference_chunking_does_not_change_results(chunk):
    hidden, weight, labels = problem(23, 18, 60, seed=5)
    got = linear_cross_entropy_reference(hidden, weight, labels, chunk_tokens=chunk)
    loss, gh, gw = ground_truth(hidden, weight, labels)
    close(got.loss, loss)
    close(got.grad_hidden, gh)
    close(got.grad_weight, gw)


def test_empty_input():
    hidden, weight, labels = problem(0, 8, 20)
    got = linear_cross_entropy(hidden, weight, labels)
    assert float(got.loss) == 0.0 and got.grad_hidden.shape == (0, 8) and torch.all(got.grad_weight == 0)


def test_rejects_what_it_does_not_support():
    hidden, weight, labels = problem(6, 8, 20)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(hidden, weight, labels, bias=torch.zeros(20))
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="int64 labels"):
        linear_cross_entropy(hidden, weight, labels.int())
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="grad_weight_acc"):
        linear_cross_entropy(hidden, weight, labels, grad_weight_acc=torch.zeros(20, 8, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cuda_bf16_against_fp32_ground_truth(cuda):
    hidden, weight, labels = problem(1000, 520, 5003, dtype=torch.bfloat16, seed=6, device="cuda")
    labels[300:400] = -100
    got = linear_cross_entropy(hidden, weight, labels, scale=1 / 1000, chunk_tokens=300)
    loss, gh, gw = ground_truth(hidden, weight, labels, 1 / 1000)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert abs(float(got.loss) - float(loss)) <= 1e-4 * abs(float(loss))  # fp32 accumulation throughout
    assert rel(got.grad_hidden, gh) < 1e-2  # dlogits and grad_hidden rounded to bf16
    assert rel(got.grad_weight, gw) < 1e-2
    assert got.grad_hidden.dtype == torch.bfloat16 and got.grad_weight.dtype == torch.float32

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    LinearCrossEntropy.apply(h, w, labels, 1 / 1000, 300).backward()
    assert w.grad.dtype == torch.bfloat16
    assert rel(h.grad, gh) < 1e-2 and rel(w.grad, gw) < 1e-2


@pytest.mark.gpu
def test_cuda_fp32_matches_reference_tightly(cuda):
    hidden, weight, labels = problem(333, 200, 1030, seed=7, device="cuda")
    got = linear_cross_entropy(hidden, weight, labels, scale=0.01, chunk_tokens=128)
    ref = linear_cross_entropy_reference(hidden, weight, labels, scale=0.01, chunk_tokens=128)
    close(got.loss, ref.loss, rtol=1e-4)
    close(got.grad_hidden, ref.grad_hidden, rtol=1e-4)
    close(got.grad_weight, ref.grad_weight, rtol=1e-4)
