"""The device memory the steps took, beside the plan's: a warning, once each, where it passed the
budget (what the caching allocator reserved) or the plan's predicted peak (what was allocated).

A plan fits its budget by the cost model's count of the step's buffers; the rank allocates what the
program and torch's kernels ask for, and the caching allocator reserves more (allocator.py). Where
either passes the plan's figure, a device with only the budget free makes the allocator give back
cached memory mid-step (slower) or run out: this says so, with by how much, after the first step that
shows it, and again whenever the excess has doubled.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from slidedp.budget import format_bytes

log = logging.getLogger("slidedp")

# Allocated beyond the plan's peak by less than this fraction of it passes without a word.
ALLOCATED_SLACK = 0.02


def overruns(*, reserved_bytes: int, allocated_bytes: int, budget_bytes: int,
             predicted_peak_bytes: int) -> dict[str, str]:
    """The overruns of one device's peaks: {"reserved" | "allocated": what to tell}; none: {}.
    `predicted_peak_bytes` 0: the plan does not say (saved without its explanation), not checked."""
    out = {}
    if reserved_bytes > budget_bytes:
        out["reserved"] = (
            f"the CUDA caching allocator reserved {format_bytes(reserved_bytes)}, "
            f"{format_bytes(reserved_bytes - budget_bytes)} over the budget of {format_bytes(budget_bytes)} "
            f"({format_bytes(allocated_bytes)} allocated at the peak): on a device with only the budget free "
            f"the allocator would have had to give back cached memory mid-step, or run out; leave that much "
            f"headroom or lower the budget")
    if predicted_peak_bytes and allocated_bytes > predicted_peak_bytes * (1 + ALLOCATED_SLACK):
        over = allocated_bytes - predicted_peak_bytes
        out["allocated"] = (
            f"{format_bytes(allocated_bytes)} allocated at the peak, {format_bytes(over)} more than the plan's "
            f"predicted {format_bytes(predicted_peak_bytes)}: the cost model misses that much of the step's "
            f"memory; a budget {format_bytes(over)} lower keeps the step within this one")
    return out


class DeviceMemoryWatch:
    """Reads the devices' peaks after a step and warns once per kind of overrun, and again each time that
    overrun has at least doubled since it was last told (a reserve that keeps growing over the steps).

    `read()` gives each rank's peaks ({"max_allocated_bytes", "max_reserved_bytes"}, None on a CPU
    rank) since the allocator's counters were last reset; `every_step` False reads them only after this
    engine's steps 1, 2, 4, 8, ... (ranks in worker processes: each read is a round trip to every one)."""

    def __init__(self, read: Callable[[], list[dict | None]], *, budget_bytes: int, predicted_peak_bytes: int,
                 every_step: bool = True):
        self.read = read
        self.budget_bytes = budget_bytes
        self.predicted_peak_bytes = predicted_peak_bytes
        self.every_step = every_step
        self.told: dict[str, int] = {}  # kind of overrun -> the excess last told [bytes]
        self.steps = 0  # taken since the watch began

    def after_step(self, step: int) -> None:
        """`step`: the optimizer's step count, for the message."""
        self.steps += 1
        if not (self.every_step or self.steps & (self.steps - 1) == 0):
            return
        for rank, peaks in enumerate(self.read()):
            if peaks is None:
                continue
            found = overruns(reserved_bytes=peaks["max_reserved_bytes"], allocated_bytes=peaks["max_allocated_bytes"],
                             budget_bytes=self.budget_bytes, predicted_peak_bytes=self.predicted_peak_bytes)
            excess = {"reserved": peaks["max_reserved_bytes"] - self.budget_bytes,
                      "allocated": peaks["max_allocated_bytes"] - self.predicted_peak_bytes}
            for kind, text in found.items():
                told = self.told.get(kind)
                if told is None or excess[kind] >= 2 * told:
                    self.told[kind] = excess[kind]
                    log.warning("slidedp: device memory by step %d (rank %d)%s: %s", step, rank,
                                "" if told is None else ", grown since last told", text)


def local_peaks(device: torch.device) -> Callable[[], list[dict | None]]:
    """`read` for a rank in this process: torch.cuda's peak counters of `device`."""
    def read() -> list[dict | None]:
        return [{"max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                 "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}]
    return read
