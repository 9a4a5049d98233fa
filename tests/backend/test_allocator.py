"""A CUDA rank's allocator: expandable segments unless the environment configures the allocator
(backend/runtime/allocator.py); a CPU rank leaves it alone."""

import pytest
import torch

from slidedp.backend.runtime import allocator


@pytest.fixture
def settings(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):  # the name torch >= 2.9 uses
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_cuda_rank_turns_on_expandable_segments(settings):
    assert allocator.expandable_segments(torch.device("cuda", 0))
    assert settings == ["expandable_segments:True"]


@pytest.mark.parametrize("name", allocator.USER_SETTINGS)
def test_user_allocator_settings_are_kept(settings, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:256")
    assert not allocator.expandable_segments(torch.device("cuda", 0))
    assert settings == []


def test_cpu_rank_leaves_the_allocator(settings):
    assert not allocator.expandable_segments(torch.device("cpu"))
    assert settings == []


def test_the_allocator_is_set_before_the_device_state_is_allocated(monkeypatch):
    """The engine's rank sets its allocator before its first device allocation: the optimizer state
    that the plan keeps on the device is made before the rank is built (run/launch.py)."""
    from slidedp.run import launch
    from tests.engine.test_device_state import compiled, device_state_plan
    from tests.models import make_model

    events = []
    monkeypatch.setattr(launch, "expandable_segments", lambda device: events.append("allocator"))
    made = launch.DeviceState

    def device_state(*args, **kwargs):
        events.append("device state")
        return made(*args, **kwargs)

    monkeypatch.setattr(launch, "DeviceState", device_state)
    model = make_model("llama")
    with compiled(model, device_state_plan(model, 2)):
        pass
    assert events[:2] == ["allocator", "device state"], events
