"""Which block's weights sit in which device slot, decided ahead for the whole step.

The step visits blocks forward then backward. With `window` slots, a block still resident at the
turn is not loaded again. Eviction is Belady's (the content whose next use is furthest), which is
optimal for a known sequence. Each load may be issued once the evicted content's last use before
it has been issued: `issue_after` is that position (-1: at the start of the step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    position: int  # the visit that needs it
    block: int
    slot: int
    issue_after: int  # issue once the visit at this position has been issued


@dataclass(frozen=True)
class WindowSchedule:
    sequence: tuple[int, ...]  # block visited at each position
    slot_of: tuple[int, ...]  # slot used at each position
    loads: tuple[Load, ...]

    @property
    def n_loads(self) -> int:
        return len(self.loads)


def schedule_window(sequence: list[int], window: int) -> WindowSchedule:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    content: list[int | None] = [None] * window
    last_use: list[int] = [-1] * window  # position of the slot's last visit so far
    slot_of, loads = [], []

    def next_use(block: int | None, after: int) -> float:
        if block is None:
            return -1.0  # empty slots first
        for q in range(after + 1, len(sequence)):
            if sequence[q] == block:
                return float(q)
        return float("inf")

    for p, block in enumerate(sequence):
        if block in content:
            slot = content.index(block)
        else:
            scores = [next_use(c, p) for c in content]
            best = max(range(window), key=lambda s: (scores[s] if content[s] is not None else float("inf") + 1, -s))
            slot = best
            loads.append(Load(position=p, block=block, slot=slot, issue_after=last_use[slot]))
            content[slot] = block
        last_use[slot] = p
        slot_of.append(slot)
    return WindowSchedule(tuple(sequence), tuple(slot_of), tuple(loads))
