"""The step time by the CP-SAT model's own formulas (cpsat.py), evaluated directly for one set of
decisions: op by op on rank 0's lanes, chunked loads in closed form, the CPU lanes as prefix sums.

It gives the simulator's makespan (the oracle lays out every piece of every rank; this computes
the same number from a tenth of the work, and the tests check they agree) and a value for every
timing variable of the model, which completes a CP-SAT hint. Local search uses it to judge moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import OFFLOADED, Decisions
from slidedp.scheduler.problem.lanes import GPU_LANES, Op, build_lanes
from slidedp.scheduler.oracles.timeline import condition


@dataclass(frozen=True)
class ClosedForm:
    makespan: int
    start: dict  # op key -> ticks (absent ops: their lane's free time, zero length)
    end: dict
    present: dict  # op key -> bool
    update_start: dict  # layer -> R_L
    cpu_end: int


def lane_update_ticks(costs: ProblemCosts, d: Decisions) -> dict[int, int]:
    """U_L = owned_o * update_piece_o: one rank's CPU lane time for layer L."""
    return {i: costs.option_of(i, c).update_lane_ticks() for i, c in enumerate(d.layers)}


def update_starts(costs: ProblemCosts, d: Decisions) -> tuple[dict[int, int], int]:
    """R_L in update order (prefix sums of U), and the lanes' end."""
    U = lane_update_ticks(costs, d)
    R, t = {}, 0
    for layer in d.order(costs.n_layers):
        R[layer] = t
        t += U[layer]
    return R, t


def duration(costs: ProblemCosts, d: Decisions, op: Op, any_offload: bool) -> int:
    """D of a present op (cpsat._duration with the literals' values)."""
    i = op.layer
    c = d.layers[i]
    o = costs.option_of(i, c)
    if op.kind == "fwd":
        return costs.prologue_fwd_ticks(d) if i == 0 else costs.blocks[i].fwd
    if op.kind == "epi":
        return costs.epilogue
    if op.kind == "bwd":
        return costs.prologue_bwd if i == 0 else costs.blocks[i].bwd[c.activation]
    if op.kind == "load":
        if op.phase == "bwd":
            return o.load_pieces * o.bwd_piece
        return o.load_pieces * (o.fwd_piece_duplex if any_offload else o.fwd_piece)
    if op.kind == "grad":
        return o.grad_pieces * o.grad_piece
    if op.kind == "all_gather":
        return o.all_gather
    if op.kind == "reduce_scatter":
        return o.reduce_scatter
    if op.kind == "offload":
        return costs.blocks[i].offload[c.activation]
    if op.kind == "reload":
        return costs.blocks[i].reload[c.activation]
    raise ValueError(op.kind)


def evaluate(costs: ProblemCosts, d: Decisions) -> ClosedForm:
    costs = costs.variant(d)  # the costs of d's choice of streamed tables
    prog = build_lanes(costs.n_blocks, d.window, costs.problem.world_size > 1, costs.head_reload)
    holds = condition(d)
    any_offload = any(c.activation in OFFLOADED for c in d.layers)
    R, cpu_end = update_starts(costs, d)
    present = {op.key: holds(op) for lane in GPU_LANES for op in prog.lanes[lane]}
    start, end = {}, {}
    heads = dict.fromkeys(GPU_LANES, 0)
    free = dict.fromkeys(GPU_LANES, 0)
    remaining = sum(len(prog.lanes[lane]) for lane in GPU_LANES)
    while remaining:
        progress = False
        for lane in GPU_LANES:
            ops = prog.lanes[lane]
            while heads[lane] < len(ops):
                op = ops[heads[lane]]
                t = free[lane]
                if present[op.key]:
                    waiting = False
                    for dep in op.deps:
                        if present.get(dep, False):
                            if dep not in end:
                                waiting = True
                                break
                            t = max(t, end[dep])
                    if waiting:
                        break
                    e = t + duration(costs, d, op, any_offload)
                    if op.chunkwise:
                        c = d.layers[op.layer]
                        o = costs.option_of(op.layer, c)
                        e = max(e, R[op.layer] + o.load_schedule(o.fwd_piece_duplex if any_offload else o.fwd_piece))
                else:
                    e = t
                start[op.key], end[op.key] = t, e
                free[lane] = e
                heads[lane] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError("the program deadlocks")
    makespan = max(max(free.values()), cpu_end)
    return ClosedForm(makespan, start, end, present, R, cpu_end)
