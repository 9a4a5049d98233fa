"""torch's CPU AdamW behind the interface of `cpu_adamw.adamw_step`: same arrays in, same arrays out.

The update is torch's own (`fused`: the kernel of `torch.optim.AdamW(fused=True)`; `foreach`: the
multi-tensor path of `AdamW(foreach=True)`), called through torch's functional AdamW on tensors that
share memory with the numpy arrays (no copy of the state). What torch does not take is added around it:

* a bf16 gradient (uint16 bits): torch's AdamW needs the gradient in the parameter's dtype, so it is
  widened into an fp32 scratch buffer first (kept per Python thread, grown as needed);
* `grad_scale != 1`: the gradient is multiplied in float32 into that scratch (torch's own `grad_scale`
  divides, which rounds differently);
* `out_bf16`: the updated parameter is copied into the bf16 view of it (`Tensor.copy_`, the rounding
  `cpu_adamw` reproduces bit for bit);
* `to=`: the state is copied into the `to` arrays, which are then updated in place.

Results agree with `cpu_adamw.adamw_step` to within an ulp or two of fp32 (the two differ in where
their float32 roundings fall), and the bf16 copies to one bf16 ulp where the fp32 results straddle
a rounding boundary (tests/backend/test_cpu_adamw_dispatch.py).

Threads: torch's intra-op thread count is process-wide, not per Python thread as Numba's team size
is. A call sets it to `num_threads` (default: `cpu_adamw.get_num_threads()`, what the Numba kernel
would use) and restores it afterwards, holding a lock, so torch-implemented updates from several
Python threads run one after another.
"""

from __future__ import annotations

import functools
import inspect
import threading

import numpy as np
import torch

__all__ = ["adamw_step_torch", "VARIANTS"]

VARIANTS = ("fused", "foreach")

_threads_lock = threading.Lock()
_scratch = threading.local()


@functools.cache
def _functional_adamw():
    """torch's functional AdamW: `adam(..., decoupled_weight_decay=True)` where torch has it, else `adamw`."""
    import torch.optim.adam as adam_mod

    if "decoupled_weight_decay" in inspect.signature(adam_mod.adam).parameters:
        return functools.partial(adam_mod.adam, decoupled_weight_decay=True)
    import torch.optim.adamw as adamw_mod

    return adamw_mod.adamw


def _fp32_scratch(numel: int) -> torch.Tensor:
    """This Python thread's fp32 scratch buffer, at least `numel` elements (first `numel` returned)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        _scratch.buf = buf
    return buf[:numel]


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing `a`'s memory; uint16 arrays are bfloat16 bit patterns."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if a.dtype == np.uint16 else t


def adamw_step_torch(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray,
                     out_bf16: np.ndarray | None = None, *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int, grad_scale: float = 1.0, num_threads: int | None = None,
                     to: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, variant: str = "fused") -> None:
    """One AdamW update by torch, with the arguments and results of `cpu_adamw.adamw_step`.

    The arguments are not validated here: `cpu_adamw.adamw_step(..., impl="torch")` validates them
    and then calls this. `variant`: "fused" or "foreach" (torch's AdamW implementations).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if param.size == 0:
        return
    if num_threads is None:  # cpu_adamw.adamw_step passes the Numba team size it would use
        num_threads = torch.get_num_threads()
    p, m, v = _tensor(param), _tensor(exp_avg), _tensor(exp_avg_sq)
    g = _tensor(grad)
    with _threads_lock:
        old_threads = torch.get_num_threads()
        if old_threads != num_threads:
            torch.set_num_threads(int(num_threads))
        try:
            with torch.no_grad():
                if g.dtype != torch.float32 or grad_scale != 1.0:
                    scratch = _fp32_scratch(g.numel())
                    scratch.copy_(g)  # widening bf16 is exact
                    if grad_scale != 1.0:
                        scratch.mul_(np.float32(grad_scale).item())  # float32 products, as the kernel's
                    g = scratch
                if to is not None:
                    pt, mt, vt = (_tensor(a) for a in to)
                    pt.copy_(p)
                    mt.copy_(m)
                    vt.copy_(v)
                    p, m, v = pt, mt, vt
                # torch's AdamW adds 1 to the step before using it: pass the count of earlier steps.
                steps = [torch.tensor(float(step - 1))]
                _functional_adamw()([p], [g], [m], [v], [], steps, foreach=variant == "foreach",
                                    fused=variant == "fused", amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                                    weight_decay=weight_decay, eps=eps, maximize=False)
                if out_bf16 is not None:
                    _tensor(out_bf16).copy_(p)
        finally:
            if old_threads != num_threads:
                torch.set_num_threads(old_threads)
