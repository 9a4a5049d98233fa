"""Which block's weights sit in which device slot over one step: the plan's load order
(`Schedule.window_loads`), plus the slot each visit reads."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.scheduler.plan import Load


@dataclass(frozen=True)
class WindowSchedule:
    sequence: tuple[int, ...]  # block visited at each position: forward, then backward
    slot_of: tuple[int, ...]  # slot read at each position
    loads: tuple[Load, ...]

    @property
    def n_loads(self) -> int:
        return len(self.loads)


def schedule_window(n_blocks: int, window: int, loads: tuple[Load, ...]) -> WindowSchedule:
    """The slot of every block visit under `loads`; refuses loads that leave a visit's block absent
    or use a slot outside the window."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sequence = tuple(range(n_blocks)) + tuple(range(n_blocks - 1, -1, -1))
    load_at = {load.position: load for load in loads}
    where: dict[int, int] = {}
    slot_of = []
    for p, block in enumerate(sequence):
        if p in load_at:
            load = load_at[p]
            if load.block != block or not 0 <= load.slot < window:
                raise ValueError(f"window_loads: load {load} does not bring block {block} into one of {window} slots")
            where = {b: s for b, s in where.items() if s != load.slot}
            where[block] = load.slot
        if block not in where:
            raise ValueError(f"window_loads: block {block} is read at visit {p} but no window load brings it")
        slot_of.append(where[block])
    return WindowSchedule(sequence, tuple(slot_of), tuple(loads))
