"""The host arena of offloaded activations: aligned pieces front to back, None when full, reusable."""

import torch

from slidedp.backend.runtime.saved_activations import HostArena


def test_arena_hands_out_aligned_views_and_refuses_what_does_not_fit():
    arena = HostArena(4096, pin=False, align=512)
    a = arena.take((3, 5), torch.float32)  # 60 bytes at 0
    b = arena.take((10,), torch.bfloat16)  # 20 bytes at 512
    assert a.shape == (3, 5) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert b.data_ptr() - a.data_ptr() == 512 and arena.used == 532
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == 15.0 and float(b.float().sum()) == 20.0  # no overlap
    assert arena.take((1024,), torch.float32) is None  # 4 KiB more does not fit
    arena.reset()
    assert arena.take((1024,), torch.float32) is not None and arena.used == 4096
    arena.close()
    assert arena.buffer.numel() == 0
