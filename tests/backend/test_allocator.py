"""A CUDA rank's allocator: expandable segments unless the environment configures the allocator
(backend/runtime/allocator.py); a CPU rank leaves it alone."""

import pytest
import torch

from slidedp.backend.runtime import allocator


@pytest.fixture
def settings(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
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
