"""Where Triton comes from, and when a kernel runs through Triton rather than its reference.

Triton is optional: without it `tl` is a stand-in that only lets kernel signatures evaluate
(`BLOCK: tl.constexpr`), kernels are never launched, and every public function takes its
PyTorch reference.

Dispatch rule (`use_triton`): Triton for CUDA tensors; for CPU tensors only under
`TRITON_INTERPRET=1` and only when every floating tensor is fp32 (the interpreter has no
bf16: it truncates instead of rounding); the reference otherwise.

Triton 3.x reads TRITON_INTERPRET when `triton.jit` decorates a function (its
`knobs.runtime.interpret`), not when a kernel runs. Two consequences:
  - Triton's own library functions (`tl.sum`, `tl.zeros`, ...) are decorated when `triton` is
    first imported, so the process's mode is fixed then. `use_triton` takes Triton only when
    TRITON_INTERPRET agrees with that mode (`library_interpreted`); otherwise the reference.
    Tests set the variable before anything imports triton (tests/backend/kernels/conftest.py).
  - This package's kernels are decorated lazily by `kernel`, on their first launch, once per
    mode, so they follow the variable as it is at launch time.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from slidedp.logs import warn_once

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work
    triton = None
    tl = SimpleNamespace(constexpr=None)

_TRUE = ("1", "true", "on", "yes")


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.cache
def library_interpreted() -> bool:
    """True when Triton was imported under TRITON_INTERPRET=1 (its library is interpreter code)."""
    from triton.runtime.jit import JITFunction  # Triton is optional: only reached when it imported

    return not isinstance(tl.sum, JITFunction)


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may run on these tensors (see the module docstring). CUDA tensors that
    cannot have their kernel (no Triton, or Triton imported in the other TRITON_INTERPRET mode) take
    the PyTorch reference with a one-time warning; CPU tensors take it quietly (the expected path)."""
    if not tensors:
        return False
    if triton is None or library_interpreted() != interpreting():
        if all(t.is_cuda for t in tensors):
            why = "Triton is not installed" if triton is None else \
                f"Triton was imported with TRITON_INTERPRET={'1' if library_interpreted() else '0'}, " \
                f"and it is now {os.environ.get('TRITON_INTERPRET', 'unset')!r}"
            warn_once(("triton", why), "GPU kernels (fused head + loss, gradient packing) fall back to their "
                      "PyTorch references, slower, and the loss then holds more device memory than the plan "
                      "charges for it (an fp32 copy of the head, 8 B a logit where the fused loss holds 6 in "
                      "bf16): %s", why)
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting() and all(
        t.device.type == "cpu" and (not t.is_floating_point() or t.dtype == torch.float32) for t in tensors)


class kernel:
    """A Triton kernel function, decorated with `triton.jit` on first launch in each mode.

    Use as a decorator; launch as usual: `my_kernel[grid](args..., BLOCK=...)`. A kernel must
    not call another kernel of this package (Triton would see this wrapper, not a jit function).
    """

    def __init__(self, fn):
        self.fn = fn
        self._jitted: dict[bool, object] = {}

    def __getitem__(self, grid):
        mode = interpreting()
        jitted = self._jitted.get(mode)
        if jitted is None:
            if triton is None:
                raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")
            jitted = self._jitted[mode] = triton.jit(self.fn)
        return jitted[grid]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
