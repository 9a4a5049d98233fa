"""A CUDA rank's allocator: expandable segments unless the environment configures the allocator, and
a cap at the plan's budget (backend/runtime/allocator.py); a CPU rank leaves it alone."""

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
    monkeypatch.setattr(launch.allocator, "configure", lambda device, budget_bytes: events.append("allocator"))
    made = launch.DeviceState

    def device_state(*args, **kwargs):
        events.append("device state")
        return made(*args, **kwargs)

    monkeypatch.setattr(launch, "DeviceState", device_state)
    model = make_model("llama")
    with compiled(model, device_state_plan(model, 2)):
        pass
    assert events[:2] == ["allocator", "device state"], events


class _Card:
    total_memory = 80 * 2**30


@pytest.fixture
def fractions(monkeypatch):
    calls = []
    def fraction(f, device):  # torch refuses a device without its index
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append((f, device))

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    return calls


@pytest.mark.parametrize("device, index", [(torch.device("cuda", 1), 1), (torch.device("cuda"), 3)])
def test_the_reserve_is_capped_at_the_budget(fractions, device, index):
    """On the device's own index; a device named without one ("cuda") is the current device."""
    assert allocator.cap_reserved(device, 40 * 2**30) == 0.5
    assert fractions == [(0.5, index)]


@pytest.mark.parametrize("budget_gib", [80, 96])
def test_a_budget_of_the_whole_card_sets_no_cap(fractions, budget_gib):
    assert allocator.cap_reserved(torch.device("cuda", 0), budget_gib * 2**30) is None
    assert fractions == []


def test_cpu_rank_sets_no_cap(fractions):
    assert allocator.cap_reserved(torch.device("cpu"), 2**30) is None
    assert fractions == []


def test_every_rank_is_built_with_its_plans_cap(monkeypatch):
    """build_rank, the path of the engine's rank, a worker process and a torchrun process alike,
    configures the allocator with the plan's budget."""
    from slidedp.backend.runtime import rank as rank_module
    from tests.engine.test_device_state import compiled, device_state_plan
    from tests.models import make_model

    budgets = []
    monkeypatch.setattr(rank_module.allocator, "configure", lambda device, budget_bytes: budgets.append(budget_bytes))
    model = make_model("llama")
    plan = device_state_plan(model, 1, budget=3 * 2**30)
    with compiled(model, plan):
        pass
    assert budgets and set(budgets) == {plan.budget_bytes}


@pytest.mark.parametrize("setting, capped", [(None, False), ("0", False), ("1", True)])
def test_the_cap_is_asked_for_in_the_environment(settings, fractions, monkeypatch, setting, capped):
    """Off by default (measured on a GPU only where the reserve outgrew the budget a little);
    SLIDEDP_CAP_RESERVED=1 turns it on."""
    if setting is None:
        monkeypatch.delenv(allocator.CAP_SETTING, raising=False)
    else:
        monkeypatch.setenv(allocator.CAP_SETTING, setting)
    allocator.configure(torch.device("cuda", 0), 40 * 2**30)
    assert settings == ["expandable_segments:True"]
    assert fractions == ([(0.5, 0)] if capped else [])
