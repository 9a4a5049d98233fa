"""The CUDA caching allocator of a rank: expandable segments, unless the user configured it.

A plan's device budget bounds what the rank allocates; the caching allocator reserves more, in
fixed-size segments that the step's mix of slots, stashes and workspaces splits and cannot give
back. Measured on the Qwen3-4B shape at 16,384 tokens with a 24 GiB plan (two H100 machines):
20.8 GiB allocated, 25.3 GiB reserved with fixed segments (1.874 s a step), 23.3 GiB with
expandable ones, segments mapped in pages that grow and shrink (1.904 s). So a rank turns them on,
where PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) does not configure the allocator already, before
its first allocation (run/launch.py: the device state is allocated before the rank is built); segments
made before keep their fixed size.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("slidedp")

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(device: torch.device) -> bool:
    """Turn on expandable segments for `device`'s allocations from now on (a CUDA device whose
    allocator the environment does not configure). Returns whether it did."""
    if device.type != "cuda":
        return False
    user = next((name for name in USER_SETTINGS if os.environ.get(name)), None)
    if user is not None:
        log.info("slidedp: CUDA allocator as %s=%s sets it (slidedp turns on expandable_segments otherwise)",
                 user, os.environ[user])
        return False
    # torch >= 2.9 names the setting per accelerator; the CUDA name before it (deprecated since)
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setting("expandable_segments:True")
    return True
