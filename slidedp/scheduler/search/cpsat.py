"""The CP-SAT model of one step: decisions -> program-order timing -> makespan, under the budget.

One model per window (the window changes the program's structure: which loads exist and which
compute frees their slot), in the order of the OR-Tools samples: data -> variables ->
constraints -> objective -> solve -> read back. Variables live in dicts keyed by domain ids and
carry structural names (`opt[L3,k4,replicated,cpu]`, `end[load[L3,fwd]]`). Times are integer
ticks (costs.TimeScale: the only place where seconds become integers).

Decisions (Booleans): act[i,a] the activation policy a of block i; opt[L,(k,d,r)] the chunk count
k and routes (delivery d, reduction r) of layer L; route[g,d,r] the routes of layer group g;
order[o] the update order across the step boundary. Ops that exist only under some decisions
(offloads, collectives, the two possible places of the epilogue's load) have a presence literal.
Update ownership is not a variable: chunk c of the layer at update position p belongs to rank
(p + c) mod W, which gives every rank the same share (note [lockstep] in oracles/timeline.py).

Timing is the simulator's rule written as precedences (start >= lane free, start >= each
dependency's end): minimised, every op starts as early as the simulator starts it, so for the
decisions returned the optimum equals the simulated step time. `solve_window` checks that with
the decisions pinned (`pinned`) and reports that value.

Symmetry: all ranks have the same GPU timeline and every rank's CPU lane the same work, so the
model holds rank 0's GPU lanes and one CPU lane. A chunked load is written in closed form: a rank
copying pieces i = 0..n-1 of a layer, piece i waiting for its chunk's update, which ends at
R_L + (j_i + 1) q (R_L: when the CPU lanes reach the layer, q: one chunk's update, j_i: the
chunk's place on its owner's lane), ends at

    end = max(s + n p, R_L + max_i ((j_i + 1) q + (n - i) p)) = max(s + D, R_L + C)

with s = max(lane free, slot free), p the copy time of a piece (TransferOption.load_schedule).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import (
    FORWARD_ORDER, GROUPS, HEAD_FIRST, KEEP, OFFLOAD, OFFLOADED, RECOMPUTE_OFFLOAD, RECOMPUTED, Decisions, LayerChoice,
)
from slidedp.scheduler.plan import input_offloaded
from slidedp.scheduler.problem.footprint import terms
from slidedp.scheduler.problem.lanes import GPU_LANES, Op, build_lanes
from slidedp.scheduler.oracles import closed_form
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.search.found import Found

STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE", cp_model.INFEASIBLE: "INFEASIBLE",
          cp_model.MODEL_INVALID: "MODEL_INVALID", cp_model.UNKNOWN: "UNKNOWN"}


@dataclass
class Vars:
    """Every variable of the model, by domain id: the only bridge between model and solution."""

    act: dict = field(default_factory=dict)  # (block, activation) -> bool
    opt: dict = field(default_factory=dict)  # (layer, (chunks, delivery, reduction)) -> bool
    route: dict = field(default_factory=dict)  # (group, delivery, reduction) -> bool
    order: dict = field(default_factory=dict)  # update order -> bool
    any_offload: object = None  # bool: some block offloads (forward loads then share the link)
    offloads: dict = field(default_factory=dict)  # block -> bool: it offloads (decisions.OFFLOADED; several allowed)
    unstash: dict = field(default_factory=dict)  # block -> bool: its input leaves the device (plan.input_offloaded)
    route_kind: dict = field(default_factory=dict)  # ("sharded" | "gpu", group) -> bool
    update_start: dict = field(default_factory=dict)  # layer -> int: R_L, when the CPU lanes reach it
    start: dict = field(default_factory=dict)  # op key -> int
    end: dict = field(default_factory=dict)  # op key -> int
    present: dict = field(default_factory=dict)  # op key -> bool, or None: always there
    both: dict = field(default_factory=dict)  # op key -> bool: AND of two `when` atoms
    head_extra: object = None  # int: U_E when the epilogue is updated second, else 0
    lane_end: dict = field(default_factory=dict)  # lane -> int: end of its last op
    kept: dict = field(default_factory=dict)  # block -> int: bytes kept by blocks 1..i (prefix sum)
    staging: object = None  # max over layers of the gradient staging bytes
    cpu_end: object = None
    makespan: object = None


@dataclass(frozen=True)
class WindowResult:
    window: int
    status: str
    decisions: Decisions | None
    objective: int | None  # ticks: the pinned (= simulated) makespan of `decisions`
    best_bound: int | None  # ticks
    wall_s: float
    deterministic_time: float
    conflicts: int
    branches: int
    n_variables: int
    n_constraints: int


# -- data ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    costs: ProblemCosts
    window: int
    ops: dict  # lane -> tuple[Op] of the ops that can exist under the options
    activations: tuple[str, ...]
    orders: tuple[str, ...]
    horizon: int  # upper bound of every time variable


def _data(costs: ProblemCosts, window: int) -> Data:
    program = build_lanes(costs.n_blocks, window, costs.problem.world_size > 1, costs.head_reload)
    acts, orders = costs.options.activations, costs.options.update_orders
    sharded = any(d == "sharded" for d, _ in costs.routes)
    gpu = any(r == "gpu" for _, r in costs.routes)

    def possible(op: Op) -> bool:
        return not any((a[0] == "offload" and not set(OFFLOADED) & set(acts)) or (a[0] == "sharded" and not sharded)
                       or (a[0] == "gpu" and not gpu) or (a[0] == "order" and a[1] not in orders)
                       for a in op.when)

    ops = {lane: tuple(op for op in program.lanes[lane] if possible(op)) for lane in GPU_LANES}
    horizon = 1 + sum(_max_duration(costs, op) for lane in GPU_LANES for op in ops[lane])
    horizon += sum(max(o.update_lane_ticks() for o in opts) for opts in costs.layer_options)
    return Data(costs, window, ops, acts, orders, horizon)


def _max_duration(costs: ProblemCosts, op: Op) -> int:
    opts = costs.layer_options[op.layer]
    if op.kind == "load":
        return max(max(o.load_pieces * max(o.fwd_piece, o.fwd_piece_duplex, o.bwd_piece),
                       o.load_schedule(max(o.fwd_piece, o.fwd_piece_duplex))) for o in opts)
    if op.kind == "grad":
        return max(o.grad_pieces * o.grad_piece for o in opts)
    if op.kind == "all_gather":
        return max(o.all_gather for o in opts)
    if op.kind == "reduce_scatter":
        return max(o.reduce_scatter for o in opts)
    if op.kind == "offload":
        return max(costs.blocks[op.layer].offload.values())
    if op.kind == "reload":
        return max(costs.blocks[op.layer].reload.values())
    if op.kind == "epi":
        return costs.epilogue
    if op.layer == 0:
        return costs.prologue_fwd if op.kind == "fwd" else costs.prologue_bwd
    if op.kind == "fwd":
        return costs.blocks[op.layer].fwd
    return max(costs.blocks[op.layer].bwd.values())


def lower_bound(costs: ProblemCosts, early: bool = False, streamed: bool = False) -> int:
    """A makespan no decisions can beat (ticks), for every window:

    max(compute: fwd_P + sum_i fwd_i + epi + sum_i min_a bwd_i,a + bwd_P,
        updates then the rest: sum_L min_o U_L,o + epi + sum_i min_a bwd_i,a + bwd_P)

    The second holds in both update orders: the epilogue (forward order) or block N (head first,
    then the epilogue after it) waits for the last update; the backward follows the epilogue.
    With early updates (no step boundary) it is only the updates: a step's CPU lane work fits in
    its period. With streamed updates (the device takes some of the updates) it is the compute alone.
    """
    bwd = sum(min(costs.blocks[i].bwd[a] for a in costs.options.activations) for i in costs.blocks)
    compute = costs.prologue_fwd + sum(b.fwd for b in costs.blocks.values()) + costs.epilogue + bwd
    compute += costs.prologue_bwd
    if streamed:
        return compute
    updates = sum(min(o.update_lane_ticks() for o in opts) for opts in costs.layer_options)
    if early:
        return max(compute, updates)
    return max(compute, updates + costs.epilogue + bwd + costs.prologue_bwd)


# -- variables ------------------------------------------------------------------------------------


def _decision_variables(m: cp_model.CpModel, costs: ProblemCosts, acts, orders) -> Vars:
    v = Vars()
    for i in costs.blocks:
        for a in acts:
            v.act[(i, a)] = m.new_bool_var(f"act[L{i},{a}]")
    for i, opts in enumerate(costs.layer_options):
        for o in opts:
            v.opt[(i, o.key)] = m.new_bool_var(f"opt[L{i},k{o.chunks},{o.delivery},{o.reduction},{o.host_copy}]")
    for g in GROUPS:
        for d, r in costs.routes:
            v.route[(g, d, r)] = m.new_bool_var(f"route[{g},{d},{r}]")
    for o in orders:
        v.order[o] = m.new_bool_var(f"order[{o}]")
    v.staging = m.new_int_var(0, max(o.staging_bytes for opts in costs.layer_options for o in opts), "staging_max")
    return v


def _variables(m: cp_model.CpModel, data: Data) -> Vars:
    c = data.costs
    v = _decision_variables(m, c, data.activations, data.orders)
    if set(OFFLOADED) & set(data.activations):
        v.any_offload = m.new_bool_var("any_offload")
    for i in range(c.n_layers):
        v.update_start[i] = m.new_int_var(0, data.horizon, f"R[L{i}]")
    for lane in GPU_LANES:
        for op in data.ops[lane]:
            v.start[op.key] = m.new_int_var(0, data.horizon, f"start[{op.key}]")
            v.end[op.key] = m.new_int_var(0, data.horizon, f"end[{op.key}]")
    v.cpu_end = m.new_int_var(0, data.horizon, "cpu_end")
    v.makespan = m.new_int_var(0, data.horizon, "makespan")
    return v


# -- constraints: decisions -------------------------------------------------------------------------


def _one_choice_each(m: cp_model.CpModel, costs: ProblemCosts, v: Vars) -> None:
    """Exactly one value per decision: sum_a act[i,a] = 1 per block, sum_o opt[L,o] = 1 per
    layer, sum_rt route[g,rt] = 1 per group, sum_o order[o] = 1."""
    for i in costs.blocks:
        m.add_exactly_one(lit for (j, _), lit in v.act.items() if j == i)
    for i, opts in enumerate(costs.layer_options):
        m.add_exactly_one(v.opt[(i, o.key)] for o in opts)
    for g in GROUPS:
        m.add_exactly_one(v.route[(g, d, r)] for d, r in costs.routes)
    if v.order:
        m.add_exactly_one(v.order.values())


def _routes_per_group(m: cp_model.CpModel, costs: ProblemCosts, v: Vars) -> None:
    """A layer's option carries its group's route: sum_{o with route rt} opt[L,o] = route[g(L),rt]."""
    for i, opts in enumerate(costs.layer_options):
        g = costs.problem.group_of(i)
        for d, r in costs.routes:
            m.add(sum(v.opt[(i, o.key)] for o in opts if (o.delivery, o.reduction) == (d, r)) == v.route[(g, d, r)])


def _offloads(m: cp_model.CpModel, v: Vars, i: int):
    """The literal of block i offloading: offloads[i] = sum_{a offloaded} act[i,a] (at most one holds;
    the one literal itself where the options allow one offloaded policy)."""
    lits = [v.act[(i, a)] for a in OFFLOADED if (i, a) in v.act]
    if len(lits) == 1:
        return lits[0]
    if i not in v.offloads:
        v.offloads[i] = m.new_bool_var(f"offloads[L{i}]")
        m.add(v.offloads[i] == sum(lits))
    return v.offloads[i]


def _offload_flag(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """any_offload = OR_i offloads[i]: offloads[i] <= any_offload <= sum_i offloads[i]."""
    if v.any_offload is None:
        return
    offloads = [_offloads(m, v, i) for i in data.costs.blocks]
    for lit in offloads:
        m.add_implication(lit, v.any_offload)
    m.add_bool_or(offloads).only_enforce_if(v.any_offload)


def _option_sum(v: Vars, layer: int, opts, value) -> cp_model.LinearExpr:
    return sum(value(o) * v.opt[(layer, o.key)] for o in opts)


def _update_lanes(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """CPU lanes, in update order from t = 0 (note [step boundary]), each the same by symmetry:
    U_L = sum_o opt[L,o] owned_o q_o;  R_P = 0;  R_next = R_L + U_L;  cpu_end = sum_L U_L.
    The epilogue comes second (order[head_first]) or last (order[forward]):
    R_B1 = U_P + HE with HE = U_E if head_first else 0;  R_E = U_P (head first), R_BN + U_BN (forward)."""
    c = data.costs
    E = c.epilogue_id
    U = {i: _option_sum(v, i, opts, lambda o: o.update_lane_ticks()) for i, opts in enumerate(c.layer_options)}
    head = v.order.get(HEAD_FIRST)
    forward = v.order.get(FORWARD_ORDER)
    blocks = list(range(1, E))
    m.add(v.update_start[0] == 0)
    he = v.head_extra = m.new_int_var(0, data.horizon, "HE")
    if head is not None:
        m.add(he == U[E]).only_enforce_if(head)
        m.add(v.update_start[E] == U[0]).only_enforce_if(head)
    if forward is not None:
        m.add(he == 0).only_enforce_if(forward)
        m.add(v.update_start[E] == v.update_start[blocks[-1]] + U[blocks[-1]]).only_enforce_if(forward)
    m.add(v.update_start[blocks[0]] == U[0] + he)
    for a, b in zip(blocks, blocks[1:]):
        m.add(v.update_start[b] == v.update_start[a] + U[a])
    m.add(v.cpu_end == sum(U.values()))


# -- constraints: the program ------------------------------------------------------------------------


def _presence(m: cp_model.CpModel, data: Data, v: Vars, op: Op):
    """The literal of an op's `when` (None: always there): offload -> offloads[i];
    sharded -> OR of route[g,sharded,*]; gpu -> OR of route[g,*,gpu]; order -> order[o];
    two atoms -> their AND."""
    c = data.costs
    lits = []
    for atom in op.when:
        kind = atom[0]
        if kind == "offload":
            lits.append(_offloads(m, v, atom[1]))
        elif kind == "order":
            lits.append(v.order[atom[1]])
        else:
            g = c.problem.group_of(atom[1])
            if (kind, g) not in v.route_kind:
                lit = m.new_bool_var(f"{kind}[{g}]")
                routes = [(d, r) for d, r in c.routes if (d == "sharded" if kind == "sharded" else r == "gpu")]
                m.add(lit == sum(v.route[(g, d, r)] for d, r in routes))
                v.route_kind[(kind, g)] = lit
            lits.append(v.route_kind[(kind, g)])
    if not lits:
        return None
    if len(lits) == 1:
        return lits[0]
    both = m.new_bool_var(f"present[{op.key}]")
    m.add_bool_and(lits).only_enforce_if(both)
    m.add_bool_or([x.negated() for x in lits]).only_enforce_if(both.negated())
    v.both[op.key] = both
    return both


def _duration(data: Data, v: Vars, op: Op, duplex: bool = False):
    """D of an op, affine in the decision literals (ticks): compute from the activation; copies
    from the option (pieces x piece time); `duplex`: a forward load's pieces while offloads go down."""
    c = data.costs
    i, opts = op.layer, c.layer_options[op.layer]
    if op.kind == "fwd":
        return c.prologue_fwd if i == 0 else c.blocks[i].fwd
    if op.kind == "epi":
        return c.epilogue
    if op.kind == "bwd":
        return c.prologue_bwd if i == 0 else sum(c.blocks[i].bwd[a] * v.act[(i, a)] for a in data.activations)
    if op.kind == "load":
        if op.phase == "bwd":
            return _option_sum(v, i, opts, lambda o: o.load_pieces * o.bwd_piece)
        return _option_sum(v, i, opts, lambda o: o.load_pieces * (o.fwd_piece_duplex if duplex else o.fwd_piece))
    if op.kind == "grad":
        return _option_sum(v, i, opts, lambda o: o.grad_pieces * o.grad_piece)
    if op.kind == "all_gather":
        return max(o.all_gather for o in opts)
    if op.kind == "reduce_scatter":
        return max(o.reduce_scatter for o in opts)
    if op.kind in ("offload", "reload"):
        ticks = c.blocks[i].offload if op.kind == "offload" else c.blocks[i].reload
        return sum(ticks[a] * v.act[(i, a)] for a in OFFLOADED if (i, a) in v.act)
    raise ValueError(op.kind)


def _load_schedule(data: Data, v: Vars, op: Op, duplex: bool = False):
    """C of a chunkwise load: sum_o opt[L,o] C_o(p_o), p_o the (duplex) forward piece time."""
    opts = data.costs.layer_options[op.layer]
    return _option_sum(v, op.layer, opts,
                       lambda o: o.load_schedule(o.fwd_piece_duplex if duplex else o.fwd_piece))


def _program_order(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """Each lane runs its ops in program order (program.py). For an op with presence p (1 if it
    always exists), D its duration, R_L + C its chunkwise bound:

        s_op >= e_prev                          (the lane's previous op; an absent op has length 0)
        s_op >= e_dep          if p_op, p_dep   (every dependency that exists)
        e_op >= s_op,  e_op >= s_op + D_op      if p_op        (= when the op always exists)
        e_op >= R_L + C_op                      if p_op        (chunkwise loads)
        forward loads, if any_offload: the same two with the duplex piece time

    Minimising the makespan starts every op as early as this allows, which is the simulator's
    rule (start = max(lane free, dependencies' ends)). Optionally, redundantly, an interval
    [e - D, e) per op (optional with p) and NoOverlap per lane."""
    options = data.costs.options
    intervals_wanted = options.redundant_no_overlap
    if intervals_wanted is None:
        intervals_wanted = data.costs.n_blocks <= options.all_windows_up_to_blocks
    for lane in GPU_LANES:
        for op in data.ops[lane]:
            v.present[op.key] = _presence(m, data, v, op)
    for lane in GPU_LANES:
        previous = None
        intervals = []
        for op in data.ops[lane]:
            s, e, lit = v.start[op.key], v.end[op.key], v.present[op.key]
            own = [] if lit is None else [lit]
            if previous is not None:
                m.add(s >= previous)
            for dep in op.deps:
                if dep in v.end:
                    dep_lit = v.present[dep]
                    m.add(s >= v.end[dep]).only_enforce_if(own + ([] if dep_lit is None else [dep_lit]))
            dur = _duration(data, v, op)
            if lit is None and not op.chunkwise:
                m.add(e == s + dur)
            else:
                m.add(e >= s)
                m.add(e >= s + dur).only_enforce_if(own)
            if op.chunkwise:
                m.add(e >= v.update_start[op.layer] + _load_schedule(data, v, op)).only_enforce_if(own)
            if op.kind == "load" and op.phase == "fwd" and v.any_offload is not None:
                both = own + [v.any_offload]
                m.add(e >= s + _duration(data, v, op, duplex=True)).only_enforce_if(both)
                m.add(e >= v.update_start[op.layer] + _load_schedule(data, v, op, duplex=True)).only_enforce_if(both)
            if intervals_wanted:
                intervals.append(_busy_interval(m, data, op, e, dur, lit))
            previous = e
        v.lane_end[lane] = previous if previous is not None else 0
        if intervals:
            m.add_no_overlap(intervals)


def _busy_interval(m: cp_model.CpModel, data: Data, op: Op, e, dur, lit):
    """[e - D, e): the op's busy time at the end of its span (a chunked load may wait between
    pieces, never after its last one); optional when the op is."""
    present = [] if lit is None else [lit]
    size = m.new_int_var(0, data.horizon, f"busy[{op.key}]")
    m.add(size == dur).only_enforce_if(present)  # an absent op's duration may exceed the horizon
    start = m.new_int_var(0, data.horizon, f"busy_start[{op.key}]")
    m.add(start + size == e).only_enforce_if(present)
    if lit is None:
        return m.new_interval_var(start, size, e, f"iv[{op.key}]")
    return m.new_optional_interval_var(start, size, e, lit, f"iv[{op.key}]")


def memory_constraints(m: cp_model.CpModel, costs: ProblemCosts, window: int, v: Vars, cap) -> None:
    """Device memory at every compute position x (footprint.py) within `cap` (the budget, or a
    variable when minimising the peak):

        staging >= sum_o opt[L,o] staging_o                        for every layer L
        kept_i = kept_(i-1) + m saved_i act[i,keep]                 (blocks 1..i keep, prefix sum)
        unstash_i = act[i,recompute_offload] AND (act[i-1,recompute] + act[i-1,recompute_offload])
        base(x) + staging + kept_(j(x)) + sum_i (offload and recompute terms(x) act[i,.])
            - sum_i (unstashed terms(x) unstash_i) <= cap
        G sum_i,a m host_i,a act[i,a] + sum_L,o copy_L,o opt[L,o] <= G host_offload_bytes
                                       (host memory of one host's G ranks and kept copies, when limited)

    where blocks 1..j(x) hold kept activations at x (j = i at block i's forward and backward) and
    host_i,a the bytes an offloaded policy a of block i puts on the host per micro-batch."""
    for i, opts in enumerate(costs.layer_options):
        m.add(v.staging >= sum(o.staging_bytes * v.opt[(i, o.key)] for o in opts))
    m_batches = costs.problem.micro_batches
    running = 0
    prefix = {0: 0}
    for i in sorted(costs.blocks):
        if (i, KEEP) in v.act:
            total = running + m_batches * costs.blocks[i].saved_bytes
            var = m.new_int_var(0, total, f"kept[L{i}]")
            m.add(var == prefix[i - 1] + m_batches * costs.blocks[i].saved_bytes * v.act[(i, KEEP)])
            running, prefix[i] = total, var
        else:
            prefix[i] = 0
        v.kept[i] = prefix[i]
    for i in costs.blocks:
        before = [v.act[(i - 1, a)] for a in RECOMPUTED if (i - 1, a) in v.act]
        if (i, RECOMPUTE_OFFLOAD) in v.act and before:
            lit = v.unstash[i] = m.new_bool_var(f"unstash[L{i}]")
            m.add_implication(lit, v.act[(i, RECOMPUTE_OFFLOAD)])
            m.add(lit <= sum(before))
            m.add(lit >= v.act[(i, RECOMPUTE_OFFLOAD)] + sum(before) - 1)
    program = build_lanes(costs.n_blocks, window, costs.problem.world_size > 1, costs.head_reload)
    for t in terms(costs, window, program.compute_keys):
        expr = t.base_bytes + v.staging
        expr += prefix[t.keep_upto]
        for policies, pairs in (((OFFLOAD,), t.offload), (RECOMPUTED, t.recompute)):
            expr += sum(b * v.act[(i, p)] for p in policies for i, b in pairs if (i, p) in v.act)
        expr -= sum(b * v.unstash[i] for i, b in t.unstashed if i in v.unstash)
        m.add(expr <= cap)
    limit, G = costs.problem.host_offload_bytes, costs.problem.ranks_per_host
    host = [(G * m_batches * b.host_bytes[a], v.act[(i, a)]) for i, b in costs.blocks.items() for a in OFFLOADED
            if (i, a) in v.act]
    host += [(o.copy_host_bytes, v.opt[(i, o.key)]) for i, opts in enumerate(costs.layer_options) for o in opts
             if o.copy_host_bytes]
    if limit is not None and host:  # host memory of the offloaded activations and the kept delivery copies
        m.add(sum(b * lit for b, lit in host) <= G * limit)


def _makespan(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """makespan >= end of every GPU lane's last op, makespan >= cpu_end (note [step boundary] in
    oracles/timeline.py), makespan >= lower_bound (valid for any decisions; it helps the search's bound)."""
    for lane in GPU_LANES:
        m.add(v.makespan >= v.lane_end[lane])
    m.add(v.makespan >= v.cpu_end)
    m.add(v.makespan >= lower_bound(data.costs))


# -- hints and read back ------------------------------------------------------------------------------


def _decision_values(costs: ProblemCosts, v: Vars, d: Decisions):
    """(literal, value) of every decision variable for decisions `d` (hints, pinning)."""
    out = [(lit, d.layers[i].activation == a) for (i, a), lit in v.act.items()]
    chosen = {i: (x.chunks, x.delivery, x.reduction, x.host_copy) for i, x in enumerate(d.layers)}
    out += [(lit, chosen[i] == key) for (i, key), lit in v.opt.items()]
    first = {"prologue": 0, "blocks": 1, "epilogue": costs.epilogue_id}
    out += [(lit, (d.layers[first[g]].delivery, d.layers[first[g]].reduction) == (dl, r))
            for (g, dl, r), lit in v.route.items()]
    out += [(lit, d.update_order == o) for o, lit in v.order.items()]
    return out


def _read_back(solver: cp_model.CpSolver, costs: ProblemCosts, v: Vars, window: int, acts, orders) -> Decisions:
    layers = []
    for i, opts in enumerate(costs.layer_options):
        key = next(o.key for o in opts if solver.boolean_value(v.opt[(i, o.key)]))
        act = costs.edge_activation(i) if i not in costs.blocks else next(a for a in acts if solver.boolean_value(v.act[(i, a)]))
        layers.append(LayerChoice(key[0], act, key[1], key[2], key[3]))
    order = next((o for o in orders if solver.boolean_value(v.order[o])), orders[0]) if v.order else orders[0]
    return Decisions(window, order, tuple(layers))


# -- solve -----------------------------------------------------------------------------------------------


def _parameters(solver: cp_model.CpSolver, costs: ProblemCosts, deterministic_time: float,
                presolve: bool = False) -> None:
    p = solver.parameters
    p.num_workers = costs.options.workers
    p.random_seed = costs.options.seed
    p.max_deterministic_time = deterministic_time
    # The timing models start from a complete hint; presolve (probing above all) costs seconds on
    # models of a few thousand variables, counted in wall time and not in deterministic time.
    p.cp_model_presolve = presolve
    p.cp_model_probing_level = 0


def build_model(costs: ProblemCosts, window: int, budget_bytes: int, upper_bound: int | None = None):
    """The whole model for one window: data, variables, constraints, objective. `upper_bound`
    (ticks; e.g. a hint's simulated makespan) bounds every time variable."""
    data = _data(costs, window)
    if upper_bound is not None:
        data = replace(data, horizon=max(min(data.horizon, upper_bound), lower_bound(costs)))
    m = cp_model.CpModel()
    v = _variables(m, data)
    _one_choice_each(m, costs, v)
    _routes_per_group(m, costs, v)
    _offload_flag(m, data, v)
    _update_lanes(m, data, v)
    _program_order(m, data, v)
    memory_constraints(m, costs, window, v, budget_bytes)
    _makespan(m, data, v)
    m.minimize(v.makespan)
    return m, data, v


def _complete_hint(m: cp_model.CpModel, costs: ProblemCosts, data: Data, v: Vars, d: Decisions) -> int:
    """Hint every variable with its value under decisions `d` (closed_form.py gives the times):
    the search starts from a complete, feasible solution. Returns its makespan."""
    cf = closed_form.evaluate(costs, d)
    values = list(_decision_values(costs, v, d))
    if v.any_offload is not None:
        values.append((v.any_offload, any(c.activation in OFFLOADED for c in d.layers)))
    values += [(lit, d.layers[i].activation in OFFLOADED) for i, lit in v.offloads.items()]
    activation = {i: d.layers[i].activation for i in costs.blocks}
    values += [(lit, input_offloaded(activation, i)) for i, lit in v.unstash.items()]
    for (kind, g), lit in v.route_kind.items():
        first = d.layers[{"prologue": 0, "blocks": 1, "epilogue": costs.epilogue_id}[g]]
        values.append((lit, first.delivery == "sharded" if kind == "sharded" else first.reduction == "gpu"))
    values += [(lit, cf.present[key]) for key, lit in v.both.items()]
    U = closed_form.lane_update_ticks(costs, d)
    values.append((v.head_extra, U[costs.epilogue_id] if d.update_order == HEAD_FIRST else 0))
    values += [(var, cf.update_start[i]) for i, var in v.update_start.items()]
    values += [(v.start[k], cf.start[k]) for k in v.start] + [(v.end[k], cf.end[k]) for k in v.end]
    kept = 0
    for i in sorted(costs.blocks):
        if d.layers[i].activation == KEEP:
            kept += costs.problem.micro_batches * costs.blocks[i].saved_bytes
        if not isinstance(v.kept[i], int):
            values.append((v.kept[i], kept))
    values.append((v.staging, max(costs.option_of(i, c).staging_bytes
                                  for i, c in enumerate(d.layers))))
    values += [(v.cpu_end, cf.cpu_end), (v.makespan, cf.makespan)]
    for var, value in values:
        m.add_hint(var, int(value))
    return cf.makespan


def solve_window(costs: ProblemCosts, window: int, budget_bytes: int, hint: Decisions | None,
                 deterministic_time: float) -> WindowResult:
    """Minimise the makespan for one window. FEASIBLE (a time limit was reached) is a normal result.

    The search starts from the hint (decisions that fit, completed with their timing) and is
    bounded by its makespan. Decisions other than the hint's are then pinned and re-solved
    (`pinned`): that objective must equal their simulated step time (asserted), and is reported.
    """
    upper = closed_form.evaluate(costs, hint).makespan if hint is not None and costs.options.hints else None
    m, data, v = build_model(costs, window, budget_bytes, upper)
    if upper is not None:
        _complete_hint(m, costs, data, v, hint)
    solver = cp_model.CpSolver()
    _parameters(solver, costs, deterministic_time)
    t0 = time.perf_counter()
    status = solver.solve(m)
    wall = time.perf_counter() - t0
    decisions = objective = None
    bound = int(round(solver.best_objective_bound)) if status != cp_model.INFEASIBLE else None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        decisions = _read_back(solver, costs, v, window, data.activations, data.orders)
        if upper is not None and decisions == hint:
            objective = upper
        else:
            objective, _ = pinned(costs, decisions, budget_bytes)
        if status == cp_model.OPTIMAL:
            assert objective == int(round(solver.objective_value)), (objective, solver.objective_value)
    proto = m.proto
    return WindowResult(window, STATUS[status], decisions, objective, bound, wall, solver.deterministic_time,
                        solver.num_conflicts, solver.num_branches, len(proto.variables), len(proto.constraints))


def pinned(costs: ProblemCosts, d: Decisions, budget_bytes: int) -> tuple[int, list[int]]:
    """Solve the model with every decision pinned to `d` (OPTIMAL: a longest path). Returns its
    makespan, asserted equal to the simulated one, and the value of every model variable."""
    simulated = simulate(costs, d, all_ranks=False).makespan
    m, data, v = build_model(costs, d.window, budget_bytes, simulated)
    for lit, value in _decision_values(costs, v, d):
        m.add(lit == int(value))
    solver = cp_model.CpSolver()
    _parameters(solver, costs, 60.0)
    status = solver.solve(m)
    assert status == cp_model.OPTIMAL, f"the pinned model ended {STATUS[status]} (window {d.window})"
    objective = int(round(solver.objective_value))
    assert objective == simulated, (
        f"CP-SAT makespan {objective} != simulated {simulated} ticks for the same decisions (window {d.window})")
    values = [solver.value(m.get_int_var_from_proto_index(i)) for i in range(len(m.proto.variables))]
    return objective, values


def minimum_peak(costs: ProblemCosts, window: int, deterministic_time: float = 30.0) -> tuple[int, int, Decisions]:
    """The smallest peak device memory over every decision with this window: (the least peak found,
    the proven lower bound, decisions reaching that peak). Both are the same where CP-SAT proves the
    minimum (OPTIMAL); a model it cannot close in `deterministic_time` gives its best peak and its bound.

    A host budget that binds the offloaded activations and inputs makes the model a knapsack: the LP
    relaxation with its cuts (linearization level 2) proves it in hundredths of a second on Qwen3-14B
    (one H200, 118 GiB of host RAM), where level 1 stopped 1-5% short after 30 deterministic seconds."""
    acts = costs.options.activations
    orders = costs.options.update_orders
    m = cp_model.CpModel()
    v = _decision_variables(m, costs, acts, orders)
    _one_choice_each(m, costs, v)
    _routes_per_group(m, costs, v)
    upper = max(o.staging_bytes for opts in costs.layer_options for o in opts) + sum(
        t.base_bytes + sum(b for _, b in t.keep + t.offload + t.recompute)
        for t in terms(costs, window, build_lanes(costs.n_blocks, window, False).compute_keys))
    peak = m.new_int_var(0, upper, "peak")
    memory_constraints(m, costs, window, v, peak)
    m.minimize(peak)
    solver = cp_model.CpSolver()
    _parameters(solver, costs, deterministic_time, presolve=True)
    solver.parameters.linearization_level = 2
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"the minimum-memory model ended {STATUS[status]} (window {window})")
    d = _read_back(solver, costs, v, window, acts, orders)
    found = int(round(solver.objective_value))
    bound = found if status == cp_model.OPTIMAL else int(math.ceil(solver.best_objective_bound))
    return found, bound, replace(d, update_order=FORWARD_ORDER if FORWARD_ORDER in orders else orders[0])


def search(costs: ProblemCosts, budget_bytes: int, start: Decisions | None, *, window: int,
           deterministic_time: float) -> tuple[Found | None, WindowResult]:
    """`solve_window` as a search strategy, hinted with `start`: what it found (None: nothing within its
    time), and its WindowResult (status, bound, statistics), which the plan reports either way."""
    result = solve_window(costs, window, budget_bytes, start, deterministic_time)
    if result.decisions is None:
        return None, result
    return Found("cp-sat", result.decisions, simulate(costs, result.decisions, all_ranks=False)), result
