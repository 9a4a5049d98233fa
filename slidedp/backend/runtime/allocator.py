"""The CUDA caching allocator of a rank: expandable segments, unless the user configured it, and a
cap at the plan's device budget.

A plan's device budget bounds what the rank allocates; the caching allocator reserves more, in
fixed-size segments that the step's mix of slots, stashes and workspaces splits and cannot give
back. Measured on the Qwen3-4B shape at 16,384 tokens with a 24 GiB plan (two H100 machines):
20.8 GiB allocated, 25.3 GiB reserved with fixed segments (1.874 s a step), 23.3 GiB with
expandable ones, segments mapped in pages that grow and shrink (1.904 s). So a rank turns them on,
where PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) does not configure the allocator already, before
its first allocation (run/launch.py: the device state is allocated before the rank is built); segments
made before keep their fixed size.

The cap (torch.cuda.set_per_process_memory_fraction, with SLIDEDP_CAP_RESERVED=1 in the environment)
makes the budget bound what the rank reserves, not only what it allocates: an allocation that would
take the reserve past it first makes the allocator give back its cached, unused pages and try again,
and fails only if the live tensors themselves need more. Without it a 40 GiB plan of the
Llama-3.2-3B shape at 16,384 tokens (H100) allocated 38.8 GiB and reserved 41.7 GiB, and a 5.3 GiB
plan of the Qwen3-4B shape allocated 4.1 GiB and reserved 6.3 GiB. It is off by default: its first
GPU run slowed the step and ended in an illegal memory access, before a buffer read on a second
stream was recorded there (benchmarks/LOG.md). Since, seven capped H100 runs held their budgets without
a fault; on one host, beside uncapped runs of the same two plans, their steps were 0.8% and 1.1% longer
(reserve 12.15 -> 12.01 GiB and 16.40 -> 16.00 GiB). Not yet run capped: a plan whose reserve outgrew its
budget by more than 0.4 GiB uncapped (the small-budget ones by up to 1.5 GiB), where the cap must give back
the most.
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


def cap_reserved(device: torch.device, budget_bytes: int) -> float | None:
    """Cap what the caching allocator of `device` reserves at `budget_bytes`. Returns the fraction of
    the device's memory it set; None where there is nothing to cap (not CUDA, or a budget of the
    whole device or more)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index  # "cuda": the current one
    total = torch.cuda.get_device_properties(index).total_memory
    if budget_bytes >= total:
        return None
    fraction = budget_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("slidedp: CUDA allocator capped at the plan's budget, %.1f%% of the device", 100 * fraction)
    return fraction


CAP_SETTING = "SLIDEDP_CAP_RESERVED"  # "1": cap the reserve at the plan's budget (the module docstring)


def configure(device: torch.device, budget_bytes: int) -> None:
    """A rank's allocator, before its first allocation: expandable segments and, where the environment
    asks for it (CAP_SETTING), the budget's cap."""
    expandable_segments(device)
    if os.environ.get(CAP_SETTING, "") == "1":
        cap_reserved(device, budget_bytes)
