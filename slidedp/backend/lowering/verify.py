"""Replays a Program without running it: happens-before, data hazards, buffer lifetimes, peak memory.

Happens-before uses vector clocks: an op inherits its stream's previous clock and the clocks of
the events it waits for. Op A happens before op B iff B's clock has reached A's position on A's
stream. The checks, each a `ProgramError` naming the op:

- every waited event is recorded by exactly one op, and the waits form no cycle (a deadlock: ops
  on two streams each waiting for an event the other records later), read from the program's
  dependency graph (`slidedp.backend.lowering.graph`), the cycle's ops named;
- every waited event was recorded by an earlier op;
- a compute op reads weight slot s only after the load of its block into s has happened;
- a load into slot s happens only after every earlier reader of s's previous content;
- a layer's gradient copy (D2H) happens after the op that produced the gradient;
- a block's backward happens after the gradient copy GRAD_ACCUMULATORS backwards earlier (the
  plan charges that many gradient buffers: costmodel/memory.py);
- buffers: no double alloc, no free without alloc, nothing left allocated at the end;
- peak device memory = persistent + the largest running sum of live buffers, within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.backend.lowering.graph import dependency_graph, event_recorders, find_deadlock, unrecorded_waits
from slidedp.backend.lowering.program import ALLOC, BWD, D2H_GRAD, EPILOGUE, FREE, FWD, H2D_WEIGHTS, PROLOGUE_BWD, Program
from slidedp.costmodel.memory import GRAD_ACCUMULATORS


class ProgramError(AssertionError):
    """The program would race, leak or exceed its memory: the message names the op."""


@dataclass(frozen=True)
class ProgramReport:
    peak_device_bytes: int
    n_ops: int
    n_loads: int
    n_waits: int


def check_dependencies(program: Program) -> None:
    """Refuse waits on events no op records, events recorded twice, and cycles of waits."""
    kind = {op.index: f"{op.kind} on {op.stream}" for op in program.ops}
    for index, event in unrecorded_waits(program):
        raise ProgramError(f"op {index} ({kind[index]}) waits for event {event}, not recorded by any op")
    for event, recorders in event_recorders(program).items():
        if len(recorders) > 1:
            raise ProgramError(f"event {event} is recorded by ops {recorders}, not by one")
    cycle = find_deadlock(dependency_graph(program))
    if cycle:
        chain = " -> ".join(f"op {u} ({kind[u]})" for u, _ in cycle) + f" -> op {cycle[0][0]}"
        raise ProgramError(f"deadlock: the waits form a cycle: {chain}")


def verify_program(program: Program, *, budget_bytes: int | None = None) -> ProgramReport:
    check_dependencies(program)
    streams = sorted({op.stream for op in program.ops})
    clock_of_stream = {s: {t: 0 for t in streams} for s in streams}
    position: dict[int, tuple[str, int]] = {}  # op index -> (stream, 1-based position on it)
    clocks: dict[int, dict[str, int]] = {}
    event_clock: dict[int, dict[str, int]] = {}
    slot_loader: dict[int, int] = {}  # slot -> index of the last load into it
    slot_block: dict[int, int] = {}
    slot_readers: dict[int, list[int]] = {}
    grad_producer: dict[int, int] = {}  # layer id -> op index of the op that made its gradient
    block_drains: list[int] = []  # op indices of the blocks' gradient copies, in backward order
    live: dict[str, int] = {}
    running = peak = 0
    n_waits = 0

    def happened(a: int, b_clock: dict[str, int]) -> bool:
        stream, pos = position[a]
        return b_clock[stream] >= pos

    for op in program.ops:
        clock = dict(clock_of_stream[op.stream])
        for e in op.waits:
            n_waits += 1
            if e not in event_clock:
                raise ProgramError(f"op {op.index} ({op.kind}) waits for event {e}, not recorded earlier")
            for s, v in event_clock[e].items():
                clock[s] = max(clock[s], v)
        clock[op.stream] += 1
        position[op.index] = (op.stream, clock[op.stream])
        clocks[op.index] = clock
        clock_of_stream[op.stream] = clock
        if op.record is not None:
            event_clock[op.record] = dict(clock)

        if op.kind == H2D_WEIGHTS:
            for reader in slot_readers.get(op.slot, []):
                if not happened(reader, clock):
                    raise ProgramError(f"op {op.index} loads slot {op.slot} before op {reader} finished reading it")
            slot_loader[op.slot], slot_block[op.slot], slot_readers[op.slot] = op.index, op.block, []
        elif op.kind in (FWD, BWD):
            if slot_block.get(op.slot) != op.block:
                raise ProgramError(f"op {op.index} ({op.kind} block {op.block}) reads slot {op.slot}, "
                                   f"which holds block {slot_block.get(op.slot)}")
            if not happened(slot_loader[op.slot], clock):
                raise ProgramError(f"op {op.index} reads slot {op.slot} before its load (op "
                                   f"{slot_loader[op.slot]}) has happened")
            slot_readers[op.slot].append(op.index)
            if op.kind == BWD:
                grad_producer[op.layer_id] = op.index
                if len(block_drains) >= GRAD_ACCUMULATORS and not happened(block_drains[-GRAD_ACCUMULATORS], clock):
                    raise ProgramError(f"op {op.index} (bwd block {op.block}) makes a gradient buffer before op "
                                       f"{block_drains[-GRAD_ACCUMULATORS]} has drained the one it replaces "
                                       f"({GRAD_ACCUMULATORS} gradient buffers)")
        elif op.kind in (EPILOGUE, PROLOGUE_BWD):
            grad_producer[op.layer_id] = op.index  # a resident layer's gradient is whole after its op
        elif op.kind == D2H_GRAD:
            producer = grad_producer.get(op.layer_id)
            if producer is None or not happened(producer, clock):
                raise ProgramError(f"op {op.index} copies layer {op.layer_id}'s gradient before it is computed")
            if program.ops[producer].kind == BWD:
                block_drains.append(op.index)
        elif op.kind == ALLOC:
            if op.buffer in live:
                raise ProgramError(f"op {op.index} allocates {op.buffer} twice")
            live[op.buffer] = op.nbytes
            running += op.nbytes
            peak = max(peak, running)
        elif op.kind == FREE:
            if op.buffer not in live:
                raise ProgramError(f"op {op.index} frees {op.buffer}, which is not allocated")
            running -= live.pop(op.buffer)
    if live:
        raise ProgramError(f"buffers still allocated at the end of the pass: {sorted(live)}")
    total = program.persistent_bytes + peak
    if budget_bytes is not None and total > budget_bytes:
        raise ProgramError(f"the program needs {total:,} B of device memory, over the budget of {budget_bytes:,} B")
    n_loads = sum(1 for op in program.ops if op.kind == H2D_WEIGHTS)
    return ProgramReport(peak_device_bytes=total, n_ops=len(program.ops), n_loads=n_loads, n_waits=n_waits)
