"""Which block's weights sit in which device slot over one step: the solver's load order
(`slidedp.scheduler.program.window_loads`, Belady eviction), plus the slot each visit reads."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.scheduler.program import Load, window_loads


@dataclass(frozen=True)
class WindowSchedule:
    sequence: tuple[int, ...]  # block visited at each position: forward, then backward
    slot_of: tuple[int, ...]  # slot read at each position
    loads: tuple[Load, ...]

    @property
    def n_loads(self) -> int:
        return len(self.loads)


def schedule_window(n_blocks: int, window: int) -> WindowSchedule:
    sequence = tuple(range(n_blocks)) + tuple(range(n_blocks - 1, -1, -1))
    loads = window_loads(n_blocks, window)
    load_at = {load.position: load for load in loads}
    where: dict[int, int] = {}
    slot_of = []
    for p, block in enumerate(sequence):
        if p in load_at:
            where[block] = load_at[p].slot
        slot_of.append(where[block])
    return WindowSchedule(sequence, tuple(slot_of), loads)
