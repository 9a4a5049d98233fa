"""Gradient packing (Triton in the interpreter, and the reference) against plain torch slicing and sums."""

import math

import pytest
import torch

from slidedp.backend.kernels import grad_pack as gp
from slidedp.backend.kernels.grad_pack import accumulate_, cast_pack, pack_grads, pack_grads_reference, scale_

# A layer of four parameters, one without a gradient, with gaps between spans. Pieces are longer
# than the kernel's BLOCK (1024) and not multiples of it. Chunks in no particular order: one
# straddles spans, one is a single element, one is empty, one covers only a gap, and
# [2500, 2600) lies outside every chunk.
SHAPES = [(30, 41), (7,), None, (100, 37)]
SPANS = [(3, 1230), (1233, 7), (1245, 500), (1745, 3700)]
N = 5456
CHUNKS = [(2600, 5450), (0, 1000), (1000, 1001), (2500, 2500), (1001, 2500), (5450, 5456)]


def make_grads(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [None if s is None else torch.randn(*s, generator=g).to(dtype) for s in SHAPES]
    grads[3] = torch.randn(37, 100, generator=g).to(dtype).T  # not contiguous: read row-major as (100, 37)
    return grads


def expected(out0, grads, spans, chunks, scale, accumulate):
    """Plain torch: the written buffer, and per chunk the sum of squares / non-finite of written values."""
    out = out0.clone()
    covered = torch.zeros(out.numel(), dtype=torch.bool)
    for g, (s, n) in zip(grads, spans):
        v = torch.zeros(n) if g is None else g.reshape(-1).float() * scale
        out[s : s + n] = (out[s : s + n].float() + v) if accumulate else v
        covered[s : s + n] = True
    values = [out[lo:hi][covered[lo:hi]].double() for lo, hi in chunks]
    sumsq = torch.tensor([float((v * v).sum()) for v in values], dtype=torch.float64)
    bad = torch.tensor([not bool(torch.isfinite(v).all()) for v in values])
    return out, sumsq, bad


def check(out, stats, want_out, want_sumsq, want_bad):
    # the same fp32 operations in the same order per element: equal bits, NaN where NaN
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    assert stats.sumsq.dtype == torch.float32 and stats.nonfinite.dtype == torch.bool
    finite = torch.isfinite(want_sumsq)
    torch.testing.assert_close(stats.sumsq[finite].double(), want_sumsq[finite], rtol=1e-5, atol=1e-30)
    assert torch.equal(stats.nonfinite, want_bad)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_pack_matches_torch(path, spy, accumulate, scale):
    grads = make_grads()
    out = torch.randn(N)
    want = expected(out, grads, SPANS, CHUNKS, scale, accumulate)
    calls = spy(gp, "_pack_triton")
    stats = pack_grads(grads, SPANS, out, CHUNKS, scale=scale, accumulate=accumulate)
    assert bool(calls) == (path == "interpret")
    check(out, stats, *want)
    assert stats.sumsq[3] == 0 and stats.sumsq[5] == 0  # the empty chunk, the gap-only chunk


@pytest.mark.parametrize("accumulate", [False, True])
def test_nonfinite_flags(path, accumulate):
    grads = make_grads(seed=1)
    grads[0][5, 5] = math.inf  # chunk (0, 1000)
    grads[3][30, 3] = math.nan  # chunk (2600, 5450)
    out = torch.randn(N)
    out[1242] = math.inf  # a gap inside chunk (1001, 2500): not written, not read, not counted
    out[1500] = -math.inf  # under the gradient-less span: counted only when accumulating
    want = expected(out, grads, SPANS, CHUNKS, 0.5, accumulate)
    stats = pack_grads(grads, SPANS, out, CHUNKS, scale=0.5, accumulate=accumulate)
    check(out, stats, *want)
    assert stats.nonfinite.tolist() == [True, True, False, False, accumulate, False]
    assert out[1242] == math.inf


def test_micro_batches_like_the_executor(path):
    """First micro-batch written, the rest added; stats on the last pass only; spans tile the layer."""
    spans = [(0, 1230), (1230, 7), (1237, 500), (1737, 3700)]
    n = 5437
    chunks = [(0, 2000), (2000, 4000), (4000, n)]
    batches = [make_grads(seed=s) for s in range(3)]
    batches[1][0] = None  # a parameter unused in one micro-batch
    acc = torch.full((n,), math.nan)  # no zero fill needed: the first pass writes everything
    for m, grads in enumerate(batches):
        stats = pack_grads(grads, spans, acc, chunks if m == 2 else (), scale=1 / 3, accumulate=m > 0)
    want = torch.zeros(n)
    for grads in batches:
        for g, (s, k) in zip(grads, spans):
            if g is not None:
                want[s : s + k].add_(g.reshape(-1) * (1 / 3))
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.cat([acc[lo:hi] for lo, hi in chunks]), acc)
    torch.testing.assert_close(stats.sumsq.sum(), torch.dot(acc, acc), rtol=1e-5, atol=0)
    assert not stats.nonfinite.any()


def test_cast_pack(path):
    src = torch.randn(3001) * 1e3
    chunks = [(0, 1500), (1500, 3001)]
    out = torch.empty(3001)
    stats = cast_pack(src, out, chunks, scale=0.5)
    assert torch.equal(out, src * 0.5)
    want = torch.stack([(out[lo:hi].double() ** 2).sum() for lo, hi in chunks])
    torch.testing.assert_close(stats.sumsq.double(), want, rtol=1e-5, atol=0)


def test_accumulate_and_scale(path):
    g = torch.Generator().manual_seed(3)
    dst = torch.randn(40, 77, generator=g)
    src = torch.randn(40, 77, generator=g)
    before = dst.clone()
    assert accumulate_(dst, src, 0.5) is dst
    assert torch.equal(dst, before + src * 0.5)
    t = torch.randn(3, 1111, generator=g)
    before = t.clone()
    assert scale_(t, 0.125) is t
    assert torch.equal(t, before * 0.125)


# ------------------------------------------------------------------------------------------
# the reference alone: bf16 gradients and a bf16 output (the interpreter has no bf16)


def test_reference_bf16_grads_into_fp32():
    grads = make_grads(torch.bfloat16, seed=4)
    out = torch.randn(N)
    want = expected(out, grads, SPANS, CHUNKS, 0.25, True)
    check(out, pack_grads_reference(grads, SPANS, out, CHUNKS, scale=0.25, accumulate=True), *want)


def test_reference_cast_to_bf16_rounds_like_torch():
    src = torch.randn(3001) * torch.exp2(torch.randint(-30, 30, (3001,)).float())
    src[7] = 3.4e38  # finite in fp32, past bf16's largest: rounds to inf
    out = torch.empty(3001, dtype=torch.bfloat16)
    stats = pack_grads_reference([src], [(0, 3001)], out, [(0, 1000), (1000, 3001)])
    assert torch.equal(out.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert stats.nonfinite.tolist() == [True, False]
    torch.testing.assert_close(stats.sumsq[1].double(), (out[1000:].double() ** 2).sum(), rtol=1e-5, atol=0)


def test_rejects_bad_layouts():
    g = [torch.ones(10), torch.ones(10)]
    out = torch.zeros(30)
    with pytest.raises(ValueError, match="spans overlap"):
        pack_grads(g, [(0, 10), (5, 10)], out)
    with pytest.raises(ValueError, match="chunks overlap"):
        pack_grads(g, [(0, 10), (10, 10)], out, [(0, 15), (14, 20)])
    with pytest.raises(ValueError, match="outside"):
        pack_grads(g, [(0, 10), (25, 10)], out)
    with pytest.raises(ValueError, match="elements"):
        pack_grads(g, [(0, 10), (10, 9)], out)
    with pytest.raises(ValueError, match="fp32"):
        pack_grads(g, [(0, 10), (10, 10)], out.bfloat16(), accumulate=True)
    with pytest.raises(ValueError, match="1-D"):
        pack_grads(g, [(0, 10), (10, 10)], out.view(5, 6))


# ------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cuda_bf16_grads_accumulate_and_cast(cuda):
    grads = [None if g is None else g.cuda() for g in make_grads(torch.bfloat16, seed=5)]
    grads[0][1, 2] = math.inf
    acc = torch.randn(N, device="cuda")
    acc_ref = acc.clone()
    stats = pack_grads(grads, SPANS, acc, CHUNKS, scale=0.25, accumulate=True)
    ref = pack_grads_reference(grads, SPANS, acc_ref, CHUNKS, scale=0.25, accumulate=True)
    torch.testing.assert_close(acc, acc_ref, rtol=1e-6, atol=1e-7, equal_nan=True)  # FMA may differ by an ulp
    torch.testing.assert_close(stats.sumsq, ref.sumsq, rtol=1e-5, atol=0, equal_nan=True)
    assert torch.equal(stats.nonfinite, ref.nonfinite) and bool(stats.nonfinite[1])

    src = torch.randn(1 << 20, device="cuda") * torch.exp2(torch.randint(-30, 30, (1 << 20,), device="cuda").float())
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    chunks = [(0, 300_001), (300_001, 1 << 20)]
    stats = cast_pack(src, out, chunks)
    assert torch.equal(out.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))  # round to nearest even
    want = torch.stack([(out[lo:hi].double() ** 2).sum() for lo, hi in chunks]).float()
    torch.testing.assert_close(stats.sumsq, want, rtol=1e-5, atol=0)
    assert not stats.nonfinite.any()
