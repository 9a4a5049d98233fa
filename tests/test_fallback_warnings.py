"""No fallback is silent: each one logs a WARNING on the "slidedp" logger once, with its reason;
the normal path logs none."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from slidedp import logs
from slidedp.backend.kernels import _triton
from slidedp.costmodel.hardware import PRESETS, resolve_hardware
from slidedp.ir.build import build_layer_graph
from slidedp.ir.compiled_saved import compiled_saved_bytes
from tests.models import make_model


@pytest.fixture
def warnings(monkeypatch, caplog):
    """The WARNING messages of the "slidedp" logger, with the once-per-process memory emptied."""
    monkeypatch.setattr(logs, "_warned", set())
    caplog.set_level(logging.WARNING, logger="slidedp")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name.startswith("slidedp")]


def _fake_gpu(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=48 * 2**30))


def test_an_unknown_gpu_gets_the_h100_preset_with_one_warning(monkeypatch, warnings):
    _fake_gpu(monkeypatch, "NVIDIA L40S")
    for _ in range(3):
        hw = resolve_hardware(None, "cuda")
    assert hw.name == "nvidia l40s" and hw.matmul_flops_per_s == PRESETS["h100-sxm"].matmul_flops_per_s
    [message] = warnings()
    assert "'nvidia l40s'" in message and "h100-sxm" in message
    assert "slidedp calibrate --out hw.json" in message and 'hardware="hw.json"' in message


def test_a_known_gpu_or_a_given_profile_warns_nothing(monkeypatch, warnings):
    _fake_gpu(monkeypatch, "NVIDIA H200")
    assert resolve_hardware(None, "cuda").name == "h200-sxm"
    assert resolve_hardware("a100-sxm", "cuda").name == "a100-sxm"
    assert resolve_hardware(PRESETS["cpu"], "cpu").name == "cpu"
    assert warnings() == []


def test_the_cpu_preset_is_a_guess_and_says_so_once(warnings):
    for _ in range(2):
        assert resolve_hardware(None, "cpu") is PRESETS["cpu"]
    [message] = warnings()
    assert "'cpu' preset" in message and "not measured on this machine" in message
    assert "slidedp calibrate --out hw.json" in message


def test_cuda_tensors_without_triton_take_the_reference_with_one_warning(monkeypatch, warnings):
    cuda = SimpleNamespace(is_cuda=True)  # use_triton reads only .is_cuda of a CUDA tensor
    monkeypatch.setattr(_triton, "triton", None)
    assert not _triton.use_triton(cuda, cuda) and not _triton.use_triton(cuda)
    [message] = warnings()
    assert "PyTorch references" in message and "Triton is not installed" in message


def test_triton_in_the_other_interpreter_mode_warns_once(monkeypatch, warnings):
    cuda = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(_triton, "triton", SimpleNamespace())
    monkeypatch.setattr(_triton, "library_interpreted", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not _triton.use_triton(cuda) and not _triton.use_triton(cuda)
    [message] = warnings()
    assert "TRITON_INTERPRET=1" in message


def test_the_normal_kernel_paths_warn_nothing(monkeypatch, warnings):
    cuda = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(_triton, "triton", SimpleNamespace())
    monkeypatch.setattr(_triton, "library_interpreted", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _triton.use_triton(cuda)  # CUDA: the kernel
    assert not _triton.use_triton(torch.zeros(2, dtype=torch.bfloat16))  # CPU: the reference, as expected
    monkeypatch.setattr(_triton, "triton", None)
    assert not _triton.use_triton(torch.zeros(2))  # CPU without Triton: expected too
    assert warnings() == []


def test_export_failure_warns_once_with_the_reason(monkeypatch, warnings):
    model = make_model("plain")
    build_layer_graph(model, batch_size=2, seq_len=8)
    assert warnings() == []  # export works: nothing to say

    def fail(*args, **kwargs):
        raise RuntimeError("no export today")

    monkeypatch.setattr(torch.export, "export", fail)
    for _ in range(2):
        assert build_layer_graph(model, batch_size=2, seq_len=8).trace_method == "module"
    [message] = warnings()
    assert "torch.export of PlainLM failed (RuntimeError: no export today)" in message
    assert "module structure" in message


class _Refuses(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch: AOTAutograd cannot trace it
            return self.proj(x)
        return x


def test_aot_autograd_failure_warns_once_and_the_traceable_block_not(warnings):
    good = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    assert compiled_saved_bytes(good, dict(good.named_parameters()), (x,), {}) is not None
    assert warnings() == []
    bad = _Refuses()
    for _ in range(2):
        assert compiled_saved_bytes(bad, dict(bad.named_parameters()), (x,), {}) is None
    [message] = warnings()
    assert message.startswith("AOTAutograd could not trace _Refuses (") and "eager saved tensors" in message


def test_offloaded_activations_copied_back_inside_the_backward_warn_once(warnings):
    """An offload block's saved tensors come back ahead of its backward (the program's h2d_saved op,
    `SavedActivations.reload`); where nothing brought them back, the backward copies them itself,
    with the same values, and says once that the step runs slower than its plan."""
    from slidedp.backend.runtime.saved_activations import SavedActivations
    from slidedp.backend.runtime.streams import Streams

    def grads(reload_ahead: bool):
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        saved = SavedActivations(torch.empty(0), Streams(torch.device("cpu")), offload=True, min_offload_bytes=0)
        with saved.hooks():
            loss = torch.tanh(x @ w).sum()
        if reload_ahead:
            saved.reload(torch.device("cpu"))
        (g,) = torch.autograd.grad(loss, [w])
        return g, saved

    ahead, saved = grads(True)
    assert saved.offloaded and saved.late_bytes == 0 and warnings() == []
    late, saved = grads(False)
    assert torch.equal(ahead, late) and saved.late_bytes > 0
    grads(False)
    assert len(warnings()) == 1 and "inside their backward" in warnings()[0]
