"""The path a kernel test takes: the PyTorch reference, the Triton kernels in Triton's CPU
interpreter, or the Triton kernels on CUDA.

Triton 3.x decorates its own library functions (`tl.sum`, `tl.zeros`, ...) for the interpreter
only if TRITON_INTERPRET is set when `triton` is first imported. So on a machine without CUDA
this conftest imports triton with the variable set, before the test modules import anything
(transformers, for one, imports triton), then puts the variable back: the tests that want the
interpreter set it themselves (`path`), so it does not leak into other tests, where it would
send fp32 CPU tensors through the interpreter. On a CUDA machine triton is left in compiled
mode: the interpreter tests are skipped unless the whole run has TRITON_INTERPRET=1, and then
the GPU tests are skipped.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton")
    except ImportError:
        pass
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved

from slidedp.backend.kernels._triton import library_interpreted, triton_available  # noqa: E402


@pytest.fixture(params=["reference", "interpret"])
def path(request, monkeypatch):
    """'reference': CPU torch, no Triton; 'interpret': the Triton kernels in the interpreter (fp32)."""
    if request.param == "interpret":
        if not triton_available():
            pytest.skip("triton is not installed: its kernels cannot run in the interpreter")
        if not library_interpreted():
            pytest.skip("triton was imported in compiled mode (CUDA machine, or imported before this "
                        "conftest ran): run with TRITON_INTERPRET=1 set for the whole pytest process")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


@pytest.fixture
def cuda():
    """For GPU tests: CUDA, and Triton in compiled mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if triton_available() and library_interpreted():
        pytest.skip("triton was imported in interpreter mode (TRITON_INTERPRET=1) in this process")
    return torch.device("cuda")


@pytest.fixture
def spy(monkeypatch):
    """spy(module, name) wraps module.name and returns a list that grows by one per call."""

    def install(module, name):
        calls = []
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
        return calls

    return install
