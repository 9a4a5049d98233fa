"""Steady-state step figures: which timed steps count, their median and mean, and how a table marks a
point with too few of them (or an old record without them).

The timed region (common/systems.py, Point.run) starts after the warm-up step and its CPU update
are complete, and ends after the last step's CPU update is flushed. So the first timed step is
short (slidedp: no earlier update to wait for, while every later step waits behind the previous
one's) and the last is long (it includes the final flush). Steady steps: the timed steps but the
first and the last; with fewer than three timed steps, all of them (and the point is marked).
"""

from __future__ import annotations

import statistics

MIN_STEADY_STEPS = 10  # fewer: the record says "few_steps": true, and tables mark the point
FEW_STEPS_MARK = "*"
OLD_RECORD_MARK = "†"
STEADY_RULE = ("timed steps 2..N-1 of N: the first left out (no earlier CPU update to wait for) and the last "
               "(it includes the final flush of the last updates)")
ALL_RULE = "every timed step (fewer than 3: none left out)"


def steady_fields(times: list[float], tokens: int) -> dict:
    """The record's steady-state fields from the timed steps' durations (seconds, in order)."""
    steady, rule = (times[1:-1], STEADY_RULE) if len(times) >= 3 else (list(times), ALL_RULE)
    median = statistics.median(steady)
    return {"median_step_s": median, "mean_step_s": statistics.fmean(steady), "tokens_per_s": tokens / median,
            "steady_steps": len(steady), "steady_rule": rule, "few_steps": len(steady) < MIN_STEADY_STEPS}


def step_figure(record: dict) -> tuple[float | None, str]:
    """(step seconds, mark) for a table: the median over the steady steps, marked FEW_STEPS_MARK with
    fewer than MIN_STEADY_STEPS of them; a record from before the steady fields: its measured_step_s
    (mean of every timed step, first and last included), marked OLD_RECORD_MARK."""
    if "steady_steps" in record:
        return record.get("median_step_s"), FEW_STEPS_MARK if record.get("few_steps") else ""
    return record.get("measured_step_s"), OLD_RECORD_MARK if record.get("measured_step_s") is not None else ""


def marks_note(records: list[dict]) -> str:
    """The note under a table that explains the marks its rows carry ("" when none does)."""
    marks = {step_figure(r)[1] for r in records}
    notes = []
    if FEW_STEPS_MARK in marks:
        notes.append(f"{FEW_STEPS_MARK} fewer than {MIN_STEADY_STEPS} steady steps (the record's \"steady_steps\"): "
                     "a rough figure")
    if OLD_RECORD_MARK in marks:
        notes.append(f"{OLD_RECORD_MARK} a record from before steady-state figures: the mean of every timed step, "
                     "the short first and the last with the final flush included")
    return "; ".join(notes)
