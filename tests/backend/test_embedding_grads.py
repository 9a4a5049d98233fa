"""The prologue's embedding gradients, recorded per micro-batch and summed in one fp32 embedding
backward, against autograd's dense gradient of the same function."""

import pytest
import torch
import torch.nn.functional as F

from slidedp.backend.runtime.embedding_grads import EmbeddingGrads


def forward(weight, ids, **kwargs):
    """An embedding followed by a use of the weight elsewhere too (that part stays autograd's)."""
    return F.embedding(ids, weight, **kwargs) * 3.0 + weight[:1].sum()


@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 0}, {"padding_idx": -1}, {"max_norm": 1.0}])
def test_recorded_embedding_gradients_match_autograd(kwargs):
    torch.manual_seed(0)
    vocab, dim = 12, 5
    weight = torch.randn(vocab, dim, requires_grad=True)
    acc = torch.zeros(vocab, dim)
    ids = [torch.randint(0, vocab, (2, 6)) for _ in range(3)]
    ids[0][0, :3] = torch.tensor([0, vocab - 1, 0])  # both padding rows seen, one twice
    grads = [torch.randn(2, 6, dim) for _ in ids]
    ref_weight = weight.detach().clone().requires_grad_(True)
    sum((forward(ref_weight, i, **kwargs) * g).sum() for i, g in zip(ids, grads)).backward()

    mode = EmbeddingGrads({id(weight): (weight, acc)})
    for i, g in zip(ids, grads):
        with mode:
            out = forward(weight, i, **kwargs)
        (dense,) = torch.autograd.grad(out, [weight], g, allow_unused=True)
        acc.add_(dense)  # what autograd still computes: the other use, and a max_norm table's lookup
    recorded = sum(len(r) for r in mode.records.values())
    mode.accumulate()
    assert recorded == (0 if "max_norm" in kwargs else len(ids)) and mode.records == {}
    torch.testing.assert_close(acc, ref_weight.grad, rtol=1e-6, atol=1e-6)


def test_untracked_weights_and_no_grad_lookups_are_left_alone():
    weight, other = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    mode = EmbeddingGrads({id(weight): (weight, torch.zeros(4, 3))})
    ids = torch.tensor([1, 2])
    with mode:
        out = F.embedding(ids, other)
        with torch.no_grad():
            F.embedding(ids, weight)
    assert mode.records == {} and out.grad_fn is not None


@pytest.mark.parametrize("padding", [-1, 0, 7, 12])
def test_the_backward_in_row_ranges_is_the_whole_tables_to_the_bit(monkeypatch, padding):
    """Made one row range at a time (ranges of 5 rows here, the last shorter), every row sums the same
    lookups in the same order as one embedding backward over the whole table; the padding row gets none."""
    import slidedp.backend.runtime.embedding_grads as eg

    monkeypatch.setattr(eg, "embedding_grad_chunk_rows", lambda rows, hidden: 5)
    torch.manual_seed(1)
    rows, hidden, n = 13, 6, 200
    ids = torch.randint(0, rows, (n,))
    ids[:20] = 12  # the last range's one row, often
    grad = torch.randn(n, hidden)
    start = torch.randn(rows, hidden)
    acc = start.clone()
    eg.add_embedding_backward_(acc, grad, ids, padding)
    whole = torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding, False)
    assert torch.equal(acc, start + whole)
    if padding >= 0:
        assert torch.equal(acc[padding], start[padding])
