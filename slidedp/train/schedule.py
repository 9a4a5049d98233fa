"""Learning-rate schedules of `slidedp train`: constant, linear or cosine decay, after a linear warm-up.

The rate of a step is a pure function of the step number and the config, so a resumed run
continues the schedule exactly from the step stored in its checkpoint.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, max_steps: int = 1,
          min_lr: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (1-based).

    Warm-up: lr * step / warmup_steps for step <= warmup_steps (the first step is not wasted
    on a zero rate). Then, with p = (step - warmup_steps - 1) / (max_steps - warmup_steps) in
    [0, 1) (the first step after warm-up has the full rate, as in Hugging Face's schedules):
    constant: lr; linear: lr + (min_lr - lr) * p; cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2.
    Steps past max_steps keep min_lr.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, (step - warmup_steps - 1) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr + (min_lr - lr) * p
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def schedule_state(step: int, **kwargs) -> dict:
    """What a checkpoint records of the schedule: its settings, the step and that step's rate."""
    return {"step": step, **kwargs, "current_lr": lr_at(max(step, 1), **kwargs)}
