"""Numba CPU AdamW against torch.optim.AdamW, bf16 rounding against torch, chunking, threads."""

import threading

import numpy as np
import pytest
import torch

from slidedp.backend.kernels import cpu_adamw
from slidedp.backend.kernels.cpu_adamw import adamw_step, bf16_bits_to_float32, float32_to_bf16_bits

N = 40_009  # spans several 16 Ki-element blocks plus a ragged tail
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _bf16_bits_torch(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 of a contiguous tensor, as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.uint16).numpy()


def _state(n: int, seed: int):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n, dtype=np.float32)
    return p, np.zeros(n, np.float32), np.zeros(n, np.float32)


def _grads(n: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    # Mixed magnitudes so moments and denominators cover a wide range.
    return [(rng.standard_normal(n, dtype=np.float32)
             * np.exp2(rng.integers(-12, 4, n)).astype(np.float32)) for _ in range(steps)]


@pytest.mark.parametrize("grad_kind", ["fp32", "bf16"])
@pytest.mark.parametrize("weight_decay,grad_scale,beta1", [
    (0.0, 1.0, 0.9), (0.1, 0.37, 0.9),
    (0.05, 1.0, 0.2),  # 1 - beta1 >= 0.5: torch's lerp takes its other formula
])
def test_matches_torch_adamw(grad_kind, weight_decay, grad_scale, beta1):
    steps = 6
    hyper = dict(HYPER, beta1=beta1)
    p, m, v = _state(N, seed=1)
    out = np.empty(N, np.uint16)
    ref = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.AdamW([ref], betas=(beta1, hyper["beta2"]), lr=hyper["lr"],
                            eps=hyper["eps"], weight_decay=weight_decay, foreach=False)
    for step, g in enumerate(_grads(N, steps, seed=2), start=1):
        if grad_kind == "bf16":
            g_bits = _bf16_bits_torch(g)
            g_ref = torch.from_numpy(g_bits.view(np.int16)).view(torch.bfloat16).float()
            g_in = g_bits
        else:
            g_ref = torch.from_numpy(g.copy())
            g_in = g
        # The reference gets the same (bf16-rounded, upcast) gradient, scaled in float32.
        ref.grad = g_ref * grad_scale
        opt.step()
        adamw_step(p, g_in, m, v, out, step=step, weight_decay=weight_decay,
                   grad_scale=grad_scale, **hyper)

    st = opt.state[ref]
    # torch's CPU sqrt (MKL) is within 1 ulp of the correctly rounded one used here.
    np.testing.assert_allclose(p, ref.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m, st["exp_avg"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(v, st["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out, _bf16_bits_torch(p))


def test_without_bf16_output_matches_with():
    p1, m1, v1 = _state(N, seed=3)
    p2, m2, v2 = p1.copy(), m1.copy(), v1.copy()
    out = np.empty(N, np.uint16)
    for step, g in enumerate(_grads(N, 3, seed=4), start=1):
        g_bits = _bf16_bits_torch(g)
        adamw_step(p1, g_bits, m1, v1, step=step, weight_decay=0.05, **HYPER)
        adamw_step(p2, g_bits, m2, v2, out, step=step, weight_decay=0.05, **HYPER)
    for a, b in [(p1, p2), (m1, m2), (v1, v2)]:
        np.testing.assert_array_equal(a, b)


def _special_float32() -> np.ndarray:
    bits = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF, 0x7FFF8000,  # NaNs
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000, 0x00018000,  # subnormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # min normal, max, overflow
        0x3F80FFFF, 0x3F817FFF, 0x3F818001,
    ]
    rng = np.random.default_rng(5)
    hi = rng.integers(0, 1 << 16, 4000, dtype=np.uint32) << 16
    halfway = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001])  # ties to even, +-1
    return np.concatenate([np.array(bits, np.uint32), halfway]).view(np.float32)


def test_float32_to_bf16_bits_exact():
    rng = np.random.default_rng(6)
    random_bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([random_bits.view(np.float32), _special_float32(),
                        rng.standard_normal(50_000, dtype=np.float32)])
    got = float32_to_bf16_bits(x)
    np.testing.assert_array_equal(got, _bf16_bits_torch(x))
    out = np.empty_like(got)
    assert float32_to_bf16_bits(x, out) is out
    np.testing.assert_array_equal(out, got)


def test_bf16_output_of_step_exact_on_specials():
    # lr = 0, zero moments and gradient: param is unchanged, out is its bf16 rounding.
    p = np.tile(_special_float32(), 3)
    n = p.size
    out = np.empty(n, np.uint16)
    p_before = p.copy()
    adamw_step(p, np.zeros(n, np.uint16), np.zeros(n, np.float32), np.zeros(n, np.float32), out,
               lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    nan = np.isnan(p_before)
    assert np.isnan(p[nan]).all()  # arithmetic may quiet a signalling NaN: bits can change
    np.testing.assert_array_equal(p[~nan].view(np.uint32), p_before[~nan].view(np.uint32))
    np.testing.assert_array_equal(out, _bf16_bits_torch(p_before))


def test_bf16_bits_to_float32_all_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = bf16_bits_to_float32(bits)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(float32_to_bf16_bits(got)[~np.isnan(got)],
                                  bits[~np.isnan(got)])


def _run_steps(chunks, num_threads=None, concurrent=False):
    """Three steps over N elements split at `chunks` boundaries; returns (p, m, v, out)."""
    p, m, v = _state(N, seed=7)
    out = np.empty(N, np.uint16)
    grads = [_bf16_bits_torch(g) for g in _grads(N, 3, seed=8)]
    bounds = list(zip([0, *chunks], [*chunks, N]))
    for step, g in enumerate(grads, start=1):
        def work(lo, hi, nt, barrier=None):
            if barrier is not None:
                barrier.wait()
            adamw_step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], out[lo:hi], step=step,
                       weight_decay=0.1, grad_scale=0.5, num_threads=nt, **HYPER)

        if concurrent:
            barrier = threading.Barrier(len(bounds))
            errors = []

            def guarded(*a):
                try:
                    work(*a)
                except BaseException as e:  # pragma: no cover - reported below
                    errors.append(e)

            threads = [threading.Thread(target=guarded, args=(lo, hi, nt, barrier))
                       for (lo, hi), nt in zip(bounds, num_threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
        else:
            for lo, hi in bounds:
                work(lo, hi, num_threads)
    return p, m, v, out


def test_chunked_equals_whole():
    whole = _run_steps([])
    halves = _run_steps([12_345])  # not block-aligned
    for a, b in zip(whole, halves):
        np.testing.assert_array_equal(a, b)


def test_concurrent_threads_on_halves():
    whole = _run_steps([])
    for _ in range(3):
        both = _run_steps([N // 2], num_threads=[2, 1], concurrent=True)
        for a, b in zip(whole, both):
            np.testing.assert_array_equal(a, b)


def test_threading_layer_is_thread_safe():
    assert cpu_adamw.threading_layer() in ("omp", "tbb")


def test_set_num_threads():
    try:
        cpu_adamw.set_num_threads(1)
        assert cpu_adamw.get_num_threads() == 1
        with pytest.raises(ValueError):
            cpu_adamw.set_num_threads(0)
        with pytest.raises(TypeError):
            cpu_adamw.set_num_threads(1.5)
    finally:
        cpu_adamw.set_num_threads(None)


def test_empty_is_noop():
    e = np.empty(0, np.float32)
    adamw_step(e, e.copy(), e.copy(), e.copy(), np.empty(0, np.uint16), step=1,
               weight_decay=0.0, **HYPER)


def _args(n=8):
    return dict(param=np.zeros(n, np.float32), grad=np.zeros(n, np.float32),
                exp_avg=np.zeros(n, np.float32), exp_avg_sq=np.zeros(n, np.float32),
                out_bf16=np.zeros(n, np.uint16))


@pytest.mark.parametrize("name,value,exc,match", [
    ("param", np.zeros(8, np.float64), TypeError, "param must have dtype float32"),
    ("grad", np.zeros(8, np.float16), TypeError, "grad must have dtype float32 or uint16"),
    ("grad", np.zeros(8, np.int16), TypeError, "grad must have dtype"),
    ("exp_avg", np.zeros(8, np.uint16), TypeError, "exp_avg must have dtype float32"),
    ("exp_avg_sq", [0.0] * 8, TypeError, "numpy.ndarray"),
    ("out_bf16", np.zeros(8, np.int16), TypeError, r"arr.view\(np.uint16\)"),
    ("out_bf16", np.zeros(8, np.float32), TypeError, "out_bf16 must have dtype uint16"),
    ("grad", np.zeros(9, np.float32), ValueError, "equal lengths"),
    ("out_bf16", np.zeros(7, np.uint16), ValueError, "equal lengths"),
    ("param", np.zeros(16, np.float32)[::2], ValueError, "contiguous"),
    ("exp_avg", np.zeros((2, 4), np.float32), ValueError, "1-D"),
])
def test_bad_inputs_raise(name, value, exc, match):
    a = _args()
    a[name] = value
    with pytest.raises(exc, match=match):
        adamw_step(**a, step=1, weight_decay=0.0, **HYPER)


def test_bad_scalars_and_aliasing_raise():
    a = _args()
    with pytest.raises(ValueError, match="step"):
        adamw_step(**a, step=0, weight_decay=0.0, **HYPER)
    with pytest.raises(TypeError, match="step"):
        adamw_step(**a, step=1.5, weight_decay=0.0, **HYPER)
    a = _args()
    a["exp_avg"] = a["param"]
    with pytest.raises(ValueError, match="overlap"):
        adamw_step(**a, step=1, weight_decay=0.0, **HYPER)
    a = _args()
    a["param"].flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        adamw_step(**a, step=1, weight_decay=0.0, **HYPER)
    with pytest.raises(TypeError):
        float32_to_bf16_bits(np.zeros(4, np.float64))
    with pytest.raises(TypeError):
        bf16_bits_to_float32(np.zeros(4, np.int16))


@pytest.mark.parametrize("bf16_grad, bf16_out", [(False, False), (True, True)])  # the fp32 and bf16 engines'
def test_out_of_place_equals_in_place_and_leaves_the_inputs(bf16_grad, bf16_out):
    rng = np.random.default_rng(3)
    n = 100_003
    p, m = rng.standard_normal(n).astype(np.float32), 0.1 * rng.standard_normal(n).astype(np.float32)
    v = np.abs(0.01 * rng.standard_normal(n)).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    g = float32_to_bf16_bits(g) if bf16_grad else g
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=4, grad_scale=0.5)
    inplace = [x.copy() for x in (p, m, v)]
    out1 = np.zeros(n, np.uint16) if bf16_out else None
    adamw_step(inplace[0], g, inplace[1], inplace[2], out1, **kw)
    src, to = [x.copy() for x in (p, m, v)], tuple(np.full(n, np.nan, np.float32) for _ in range(3))
    out2 = np.zeros(n, np.uint16) if bf16_out else None
    adamw_step(src[0], g, src[1], src[2], out2, to=to, **kw)
    for a, b in zip(inplace, to):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(src, (p, m, v)):
        np.testing.assert_array_equal(a, b)
    if bf16_out:
        np.testing.assert_array_equal(out1, out2)
    with pytest.raises(ValueError, match="must not overlap"):
        adamw_step(src[0], g, src[1], src[2], out2, to=(src[0], to[1], to[2]), **kw)
