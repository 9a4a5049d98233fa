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
from slidedp.scheduler.oracles.timeline import EARLY_ITERATIONS, condition


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
    if d.grads_streamed:
        return _steady(costs, d)
    R, cpu_end = update_starts(costs, d)

    def after_update(layer: int, o, piece: int) -> int:
        return R[layer] + o.load_schedule(piece)

    start, end, present, free = _gpu_lanes(costs, d, after_update)
    return ClosedForm(max(free, cpu_end), start, end, present, R, cpu_end)


def _steady(costs: ProblemCosts, d: Decisions) -> ClosedForm:
    """Decisions whose gradients stream into the update (note [early updates] in timeline.py; the CP-SAT
    model's `_update_lanes` and `_chunkwise`): the host layers' updates in landing order, each once its
    gradient has landed (the epilogue's also after the prologue's), at the backward's rate, after what
    the step before left on the lane; a load waits for its chunks' updates of the step before. Laid
    out again with the carry of the layout before until the carry repeats, as the simulator does."""
    host = list(d.early_order)
    early = {i: costs.early_piece(costs.option_of(i, d.layers[i])) for i in host}
    E = costs.epilogue_id
    carry: tuple[dict, int] | None = None  # (R_L - makespan per layer, cpu_end - makespan) of the step before
    for _ in range(EARLY_ITERATIONS):
        def after_update(layer: int, o, piece: int) -> int | None:
            if carry is None or layer not in carry[0]:
                return None
            return carry[0][layer] + o.load_schedule(piece, early[layer])

        start, end, present, makespan = _gpu_lanes(costs, d, after_update)
        R, t = {}, max(0, carry[1]) if carry is not None else 0
        for i in host:
            R[i] = max(t, end[f"grad[L{i}]"], end["grad[L0]"] if i == E else 0)
            t = R[i] + costs.option_of(i, d.layers[i]).owned * early[i]
        nxt = ({i: r - makespan for i, r in R.items()}, t - makespan)
        if nxt == carry:
            break
        carry = nxt
    return ClosedForm(makespan, start, end, present, R, t)


def _gpu_lanes(costs: ProblemCosts, d: Decisions, after_update):
    """Rank 0's GPU lanes op by op; a chunkwise load ends no earlier than after_update(layer, option,
    piece time) (None: no bound). Returns start, end, present (by op key) and the lanes' last end."""
    prog = build_lanes(costs.n_blocks, d.window, costs.problem.world_size > 1, costs.head_reload)
    holds = condition(d)
    any_offload = any(c.activation in OFFLOADED for c in d.layers)
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
                        o = costs.option_of(op.layer, d.layers[op.layer])
                        bound = after_update(op.layer, o, o.fwd_piece_duplex if any_offload else o.fwd_piece)
                        e = e if bound is None else max(e, bound)
                else:
                    e = t
                start[op.key], end[op.key] = t, e
                free[lane] = e
                heads[lane] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError("the program deadlocks")
    return start, end, present, max(free.values())
