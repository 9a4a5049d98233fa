"""cpu_adamw.adamw_step(impl=): torch's AdamW behind the same interface gives the Numba kernel's results
(and torch.optim.AdamW's), and "auto" takes torch exactly where TORCH_FASTER lists the case."""

import numpy as np
import pytest
import torch

from slidedp.backend.kernels import cpu_adamw, cpu_adamw_torch
from slidedp.backend.kernels.cpu_adamw import adamw_step

N = 20_011  # several Numba blocks and a ragged tail
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
STEPS = 4


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.uint16).numpy()


def _bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits).view(torch.bfloat16).float().numpy()


def _grads(grad_dtype: str, seed: int = 2):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        g = rng.standard_normal(N, dtype=np.float32) * np.exp2(rng.integers(-10, 3, N)).astype(np.float32)
        out.append(_bf16_bits(g) if grad_dtype == "bf16" else g)
    return out


def _run(impl: str, grad_dtype: str, bf16_copy: bool, weight_decay: float, grad_scale: float, **kw):
    p = np.random.default_rng(1).standard_normal(N, dtype=np.float32)
    m, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
    out = np.empty(N, np.uint16) if bf16_copy else None
    for step, g in enumerate(_grads(grad_dtype), start=1):
        g_before = g.copy()
        adamw_step(p, g, m, v, out, step=step, weight_decay=weight_decay, grad_scale=grad_scale, impl=impl,
                   **HYPER, **kw)
        np.testing.assert_array_equal(g, g_before)  # the gradient is an input only
    return p, m, v, out


def _reference(grad_dtype: str, weight_decay: float, grad_scale: float):
    """torch.optim.AdamW (single-tensor) on the same gradients, widened to fp32 and scaled in float32."""
    ref = torch.nn.Parameter(torch.from_numpy(np.random.default_rng(1).standard_normal(N, dtype=np.float32)))
    opt = torch.optim.AdamW([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=weight_decay, foreach=False)
    for g in _grads(grad_dtype):
        g32 = torch.from_numpy(_bits_to_f32(g) if grad_dtype == "bf16" else g.copy())
        ref.grad = g32 * grad_scale
        opt.step()
    st = opt.state[ref]
    return ref.detach().numpy(), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()


def _assert_bf16_close(a_bits: np.ndarray, b_bits: np.ndarray) -> None:
    """Equal, or one bf16 ulp apart (fp32 results on either side of a rounding boundary)."""
    a, b = _bits_to_f32(a_bits), _bits_to_f32(b_bits)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(a), np.abs(b), dtype=np.float32) + 1e-30)) - 7)
    assert np.all(np.abs(a - b) <= ulp)


@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bf16_copy", [False, True])
@pytest.mark.parametrize("weight_decay,grad_scale", [(0.0, 1.0), (0.1, 0.37)])
@pytest.mark.parametrize("variant", ["fused", "foreach"])
def test_torch_impl_equals_numba_and_torch_adamw(grad_dtype, bf16_copy, weight_decay, grad_scale, variant,
                                                 monkeypatch):
    if variant == "foreach":  # the study's third implementation, through the same wrapper
        fused = cpu_adamw_torch.adamw_step_torch
        monkeypatch.setattr(cpu_adamw_torch, "adamw_step_torch", lambda *a, **k: fused(*a, **k, variant="foreach"))
    numba_res = _run("numba", grad_dtype, bf16_copy, weight_decay, grad_scale)
    torch_res = _run("torch", grad_dtype, bf16_copy, weight_decay, grad_scale)
    ref = _reference(grad_dtype, weight_decay, grad_scale)
    for name, a, b, r in zip(("param", "exp_avg", "exp_avg_sq"), torch_res, numba_res, ref):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7, err_msg=f"{name}: torch impl vs numba")
        np.testing.assert_allclose(a, r, rtol=2e-6, atol=1e-7, err_msg=f"{name}: torch impl vs torch.optim.AdamW")
    if bf16_copy:
        _assert_bf16_close(torch_res[3], numba_res[3])
        np.testing.assert_array_equal(torch_res[3], _bf16_bits(torch_res[0]))  # the copy is of its own result


@pytest.mark.parametrize("bf16_copy", [False, True])
def test_torch_impl_out_of_place_leaves_the_inputs(bf16_copy):
    rng = np.random.default_rng(5)
    p, m = rng.standard_normal(N, dtype=np.float32), rng.standard_normal(N, dtype=np.float32) * 0.01
    v = np.abs(rng.standard_normal(N, dtype=np.float32)) * 1e-4
    g = _bf16_bits(rng.standard_normal(N, dtype=np.float32))
    before = (p.copy(), m.copy(), v.copy())
    results = {}
    for impl in ("numba", "torch"):
        to = tuple(np.empty(N, np.float32) for _ in range(3))
        out = np.empty(N, np.uint16) if bf16_copy else None
        adamw_step(p, g, m, v, out, step=3, weight_decay=0.05, to=to, impl=impl, **HYPER)
        for a, b in zip((p, m, v), before):
            np.testing.assert_array_equal(a, b)
        results[impl] = (*to, out)
    for a, b in zip(results["torch"][:3], results["numba"][:3]):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    if bf16_copy:
        _assert_bf16_close(results["torch"][3], results["numba"][3])


def test_torch_impl_restores_torch_threads():
    threads = torch.get_num_threads()
    p, m, v = np.ones(1000, np.float32), np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    adamw_step(p, np.ones(1000, np.float32), m, v, step=1, weight_decay=0.0, num_threads=1, impl="torch", **HYPER)
    assert torch.get_num_threads() == threads


def test_threads_buckets_and_bad_impl():
    assert [cpu_adamw.threads_bucket(n) for n in (1, 2, 4, 5, 16, 128)] == ["1", "2-4", "2-4", "5+", "5+", "5+"]
    p, m, v = np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        adamw_step(p, p.copy(), m, v, step=1, weight_decay=0.0, impl="mkl", **HYPER)


def test_the_table_is_empty_until_measured():
    assert cpu_adamw.TORCH_FASTER == frozenset()


def test_auto_takes_torch_exactly_where_the_table_says(monkeypatch):
    calls = []
    real = cpu_adamw_torch.adamw_step_torch

    def spy(*args, **kwargs):
        calls.append(kwargs["num_threads"])
        real(*args, **kwargs)

    monkeypatch.setattr(cpu_adamw_torch, "adamw_step_torch", spy)
    monkeypatch.setattr(cpu_adamw, "TORCH_FASTER", frozenset({("1", True, "bf16")}))
    n = 4096
    p, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    g_bf16, g_fp32, out = _bf16_bits(np.full(n, 0.5, np.float32)), np.full(n, 0.5, np.float32), np.empty(n, np.uint16)

    def step(g, out_bf16, **kw):
        adamw_step(p, g, m, v, out_bf16, step=1, weight_decay=0.0, **HYPER, **kw)

    step(g_bf16, out, num_threads=1)
    assert calls == [1]  # listed: torch
    step(g_fp32, out, num_threads=1)  # another gradient dtype
    step(g_bf16, None, num_threads=1)  # no bf16 copy
    step(g_bf16, out, num_threads=1, impl="numba")  # asked for
    step(g_bf16, out, num_threads=1, to=tuple(np.empty(n, np.float32) for _ in range(3)))  # out of place
    assert calls == [1]
    if cpu_adamw.numba.config.NUMBA_NUM_THREADS >= 2:
        step(g_bf16, out, num_threads=2)  # another threads bucket
        assert calls == [1]
    step(g_fp32, None, num_threads=1, impl="torch")  # asked for, whatever the table
    assert calls == [1, 1]
