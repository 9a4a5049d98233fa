"""Learning-rate schedules of `slidedp train`, computed by `transformers.get_scheduler`.

The rate of a step is a pure function of the step number and the config, so a resumed run
continues the schedule exactly from the step stored in its checkpoint.

Names (config key ``lr_schedule``) and the Hugging Face schedule each one uses:

- ``constant``: ``constant``, or ``constant_with_warmup`` when ``warmup_steps > 0``;
- ``constant_with_warmup``: the same;
- ``linear``: ``linear`` (to 0), or ``polynomial`` with power 1 and ``lr_end=min_lr`` (to ``min_lr``);
- ``cosine``: ``cosine`` (to 0), or ``cosine_with_min_lr`` with ``min_lr`` (to ``min_lr``);
- ``inverse_sqrt``: ``inverse_sqrt`` (no ``min_lr``).

Step numbering: optimizer step ``s`` (1-based) uses the multiplier λ of the Hugging Face schedule at
index ``s`` during the warm-up (``s <= warmup_steps``) and at index ``s - 1`` after it, clamped to
``max_steps``. So the first step is not wasted on a zero rate (λ(0) = 0 with a warm-up, as the HF
Trainer's first step gets), the first step after the warm-up has the full rate, and the decay reaches
``min_lr`` only past ``max_steps`` (no step is wasted at the end either).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "inverse_sqrt")


def check_schedule(schedule: str, min_lr: float = 0.0) -> None:
    """ValueError naming the config key for an unknown schedule, or a ``min_lr`` it cannot honour."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}: one of {', '.join(SCHEDULES)} (config key 'lr_schedule')")
    if schedule == "inverse_sqrt" and min_lr > 0:
        raise ValueError("config key 'min_lr': the inverse_sqrt schedule has no minimum rate; set min_lr=0")


@functools.lru_cache(maxsize=32)
def _multiplier(schedule: str, lr: float, warmup_steps: int, max_steps: int, min_lr: float) -> Callable[[int], float]:
    """λ(index) of the Hugging Face schedule for these settings (a `LambdaLR`'s lambda)."""
    import torch
    from transformers import get_scheduler

    if schedule in ("constant", "constant_with_warmup") or (schedule != "inverse_sqrt" and min_lr >= lr):
        name, extra = ("constant_with_warmup" if warmup_steps > 0 else "constant"), {}  # min_lr == lr: no decay
    elif schedule == "linear" and min_lr > 0:
        name, extra = "polynomial", {"lr_end": min_lr, "power": 1.0}
    elif schedule == "cosine" and min_lr > 0:
        name, extra = "cosine_with_min_lr", {"min_lr": min_lr}
    else:
        name, extra = schedule, {}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps,
                              scheduler_specific_kwargs=extra or None)
    return scheduler.lr_lambdas[0]


def schedule_index(step: int, warmup_steps: int, max_steps: int) -> int:
    """The index of the Hugging Face schedule that optimizer step `step` (1-based) uses."""
    return step if step <= warmup_steps else min(step - 1, max(max_steps, warmup_steps))


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, max_steps: int = 1,
          min_lr: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (1-based): ``lr * λ(schedule_index(step))``, λ the
    multiplier of the `transformers.get_scheduler` schedule named in the module docstring. Warm-up:
    lr * step / warmup_steps; steps past max_steps keep the rate of the end (min_lr)."""
    check_schedule(schedule, min_lr)
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if lr == 0:
        return 0.0
    multiplier = _multiplier(schedule, float(lr), int(warmup_steps), int(max_steps), float(min_lr))
    return lr * multiplier(schedule_index(step, warmup_steps, max_steps))


def schedule_state(step: int, **kwargs) -> dict:
    """What a checkpoint records of the schedule: its settings, the step and that step's rate."""
    return {"step": step, **kwargs, "current_lr": lr_at(max(step, 1), **kwargs)}
