"""The CP-SAT model of one step: decisions -> program-order timing -> makespan, under the budget.

One model per window (the window changes the program's structure: which loads exist and which
compute frees their slot), in the order of the OR-Tools samples: data -> variables ->
constraints -> objective -> solve -> read back. Variables live in dicts keyed by domain ids and
carry structural names (`opt[L3,k4,replicated,cpu]`, `end[load[L3,fwd]]`). Times are integer
ticks (costs.TimeScale: the only place where seconds become integers).

Decisions (Booleans): act[i,a] the activation policy a of block i; opt[L,(k,d,r,c,p,v)] the chunk
count k, routes (delivery d, reduction r), delivery copy c, placement p of the optimizer state
(host or device) and, for the prologue and epilogue, whether the vocabulary table streams (v) of
layer L; device_state[L] = sum of opt[L,.] with p on the device, where the placement is a decision
(Problem.device_state_optional); vocab_streamed[T] = sum of opt[L,.] with v, per table T where
that is a decision (Problem.vocab_choices: one per layer, one for a tied table's two); route[g,d,r]
the routes of layer group g; order[o] the update order across the step boundary. A layer's state
on the device changes its options' copies and updates (costs.py), the forward's start (the
device's AdamW: `_device_delay`), device memory and host memory (`memory_constraints`); a streamed
table its layer's options, the epilogue's compute (the logits recomputed) and device memory
(footprint.vocab_memory_deltas). Ops that exist only under some decisions (offloads,
collectives, the two possible places of the epilogue's load, a streamed head's second load) have a
presence literal.
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
    FORWARD_ORDER, GPU, GROUPS, HEAD_FIRST, KEEP, OFFLOAD, OFFLOADED, RECOMPUTE_OFFLOAD, RECOMPUTED, RESIDENT, STREAMED,
    Decisions, LayerChoice, landing_order,
)
from slidedp.scheduler.plan import input_offloaded
from slidedp.scheduler.problem.footprint import terms, vocab_memory_deltas
from slidedp.scheduler.problem.lanes import GPU_LANES, Op, build_lanes
from slidedp.scheduler.oracles import closed_form
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.search.found import Found

STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE", cp_model.INFEASIBLE: "INFEASIBLE",
          cp_model.MODEL_INVALID: "MODEL_INVALID", cp_model.UNKNOWN: "UNKNOWN"}
# A window searched below a cutoff (`solve_window`) that holds no decisions as fast: its bound is the cutoff + 1.
NOT_FASTER = "NOT_FASTER"


@dataclass
class Vars:
    """Every variable of the model, by domain id: the only bridge between model and solution."""

    act: dict = field(default_factory=dict)  # (block, activation) -> bool
    opt: dict = field(default_factory=dict)  # (layer, TransferOption.key) -> bool
    route: dict = field(default_factory=dict)  # (group, delivery, reduction) -> bool
    on_device: dict = field(default_factory=dict)  # layer -> bool, or 0 / 1 where the problem fixes it
    vocab: dict = field(default_factory=dict)  # layer -> bool: its table streams (one for a tied table's two)
    device_delay: object = None  # int: the device's AdamW's delay of the forward (None: no device state)
    order: dict = field(default_factory=dict)  # update order -> bool
    grads: object = 0  # bool: the host layers' gradients stream into their update (Decisions.grads_streamed), or 0
    grads_kept: dict = field(default_factory=dict)  # layer -> bool: its gradient is kept in host RAM
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
    host_chunk: object = None  # int: the largest chunk of a host layer (pinned staging), or a constant
    host_lean: object = None  # bool: some layer's host state is lean (load staging), or 0 / 1
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
    program = build_lanes(costs.n_blocks, window, costs.problem.world_size > 1,
                          costs.head_reload or costs.head_reload_optional)
    acts, orders = costs.options.activations, costs.options.update_orders
    sharded = any(d == "sharded" for d, _ in costs.routes)
    gpu = any(r == "gpu" for _, r in costs.routes)

    def possible(op: Op) -> bool:
        return not any((a[0] == "offload" and not set(OFFLOADED) & set(acts)) or (a[0] == "sharded" and not sharded)
                       or (a[0] == "gpu" and not gpu) or (a[0] == "order" and a[1] not in orders)
                       for a in op.when)

    ops = {lane: tuple(op for op in program.lanes[lane] if possible(op)) for lane in GPU_LANES}
    horizon = 1 + sum(_max_duration(costs, op) for lane in GPU_LANES for op in ops[lane])
    horizon += sum(max(max(o.update_lane_ticks(), o.owned * costs.early_piece(o)) for o in opts)
                   for opts in costs.layer_options)
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
        return max(costs.epilogue, costs.epilogue_streamed)
    if op.layer == 0:
        return costs.prologue_fwd + costs.device_update(costs.problem.device_capable) if op.kind == "fwd" \
            else costs.prologue_bwd
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
    fwd_p = costs.prologue_fwd + costs.device_update(costs.problem.device_state)  # the least state on the device
    compute = fwd_p + sum(b.fwd for b in costs.blocks.values()) + costs.epilogue + bwd
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
            where = "device" if o.on_device else "host"
            table = ",streamed" if o.vocab_streamed else ""
            v.opt[(i, o.key)] = m.new_bool_var(
                f"opt[L{i},k{o.chunks},{o.delivery},{o.reduction},{o.host_copy},{where}{table}]")
        if i in costs.problem.device_state_optional:
            v.on_device[i] = m.new_bool_var(f"device_state[L{i}]")
        else:
            v.on_device[i] = int(i in costs.problem.device_state)
    for group in costs.vocab_groups:  # a tied table's two layers share one
        lit = m.new_bool_var(f"vocab_streamed[{','.join(f'L{i}' for i in group)}]")
        for i in group:
            v.vocab[i] = lit
    for g in GROUPS:
        for d, r in costs.routes:
            v.route[(g, d, r)] = m.new_bool_var(f"route[{g},{d},{r}]")
    for o in orders:
        v.order[o] = m.new_bool_var(f"order[{o}]")
    if costs.problem.grads_streamable:
        v.grads = m.new_bool_var("grads_streamed")
    v.staging = m.new_int_var(0, max(o.staging_bytes for opts in costs.layer_options for o in opts), "staging_max")
    return v


def _variables(m: cp_model.CpModel, data: Data) -> Vars:
    c = data.costs
    v = _decision_variables(m, c, data.activations, data.orders)
    if set(OFFLOADED) & set(data.activations):
        v.any_offload = m.new_bool_var("any_offload")
    # with streamed gradients a layer's update may end in the next step (note [early updates])
    cpu_horizon = 2 * data.horizon
    for i in range(c.n_layers):
        v.update_start[i] = m.new_int_var(0, cpu_horizon, f"R[L{i}]")
    for lane in GPU_LANES:
        for op in data.ops[lane]:
            v.start[op.key] = m.new_int_var(0, data.horizon, f"start[{op.key}]")
            v.end[op.key] = m.new_int_var(0, data.horizon, f"end[{op.key}]")
    v.cpu_end = m.new_int_var(0, cpu_horizon, "cpu_end")
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
        if i in costs.problem.device_state_optional:  # the placement its option carries
            m.add(v.on_device[i] == sum(v.opt[(i, o.key)] for o in opts if o.on_device))
        if i in v.vocab:  # whether its table streams (never with its state on the device: no such option)
            m.add(v.vocab[i] == sum(v.opt[(i, o.key)] for o in opts if o.vocab_streamed))
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


def _streamed_gradients(m: cp_model.CpModel, costs: ProblemCosts, v: Vars) -> None:
    """What grads_streamed asks (Decisions.grads_streamed): with several ranks every host layer reduced
    on the GPUs (grads_streamed -> not opt[L,o] for each option o of the CPU reduction with the state on
    the host); the gradients it keeps in host RAM otherwise: grad_kept[L] >= 1 - grads_streamed -
    device_state[L] for each layer whose gradient may stream (costs.streamable_grads)."""
    if isinstance(v.grads, int):
        return
    if costs.problem.world_size > 1:
        for i, opts in enumerate(costs.layer_options):
            for o in opts:
                if o.reduction != GPU and not o.on_device:
                    m.add_implication(v.grads, v.opt[(i, o.key)].Not())
    for i in costs.streamable_grads:
        if not _is(v.on_device[i], 1):
            v.grads_kept[i] = m.new_bool_var(f"grad_kept[L{i}]")
            m.add(v.grads_kept[i] + v.grads + v.on_device[i] >= 1)


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


def _not(lit):
    """The negation of a literal or of a constant 0 / 1."""
    return 1 - lit if isinstance(lit, int) else lit.Not()


def _is(x, value: int) -> bool:
    """Whether `x` (a literal, or a constant 0 / 1) is the constant `value`."""
    return isinstance(x, int) and x == value


def _lits(*lits) -> list:
    """The literals among `lits`, for only_enforce_if (a constant must be 1: it is dropped)."""
    assert all(x == 1 for x in lits if isinstance(x, int)), lits
    return [x for x in lits if not isinstance(x, int)]


def _update_lanes(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """CPU lanes, each the same by symmetry (U_L = sum_o opt[L,o] owned_o q_o, one rank's share).

    At the step boundary (not grads_streamed; note [step boundary]), in update order from t = 0:
    R_P = 0;  R_next = R_L + U_L;  cpu_end = sum_L U_L. The epilogue comes second (order[head_first])
    or last (order[forward]): R_B1 = U_P + HE with HE = U_E if head_first else 0;  R_E = U_P (head
    first), R_BN + U_BN (forward).

    With the gradients streamed into the update (grads_streamed; note [early updates]): in landing
    order (blocks N..1, the prologue, the epilogue), each host layer once its gradient has landed, at
    the backward's rate q'_o (costs.early_piece), after what the step before left on the lane:
    R_L >= end[grad[L]] (the epilogue also >= end[grad[L0]]);  R_next >= R_L + U'_L;
    R_first >= cpu_end - makespan;  cpu_end >= R_last + U'_last (U'_L = sum_o opt[L,o] owned_o q'_o)."""
    c = data.costs
    E = c.epilogue_id
    U = {i: _option_sum(v, i, opts, lambda o: o.update_lane_ticks()) for i, opts in enumerate(c.layer_options)}
    head = v.order.get(HEAD_FIRST)
    forward = v.order.get(FORWARD_ORDER)
    blocks = list(range(1, E))
    he = v.head_extra = m.new_int_var(0, data.horizon, "HE")
    if head is not None:
        m.add(he == U[E]).only_enforce_if(head)
    if forward is not None:
        m.add(he == 0).only_enforce_if(forward)
    at_boundary = _lits(_not(v.grads))
    m.add(v.update_start[0] == 0).only_enforce_if(at_boundary)
    if head is not None:
        m.add(v.update_start[E] == U[0]).only_enforce_if([head] + at_boundary)
    if forward is not None:
        m.add(v.update_start[E] == v.update_start[blocks[-1]] + U[blocks[-1]]).only_enforce_if([forward] + at_boundary)
    m.add(v.update_start[blocks[0]] == U[0] + he).only_enforce_if(at_boundary)
    for a, b in zip(blocks, blocks[1:]):
        m.add(v.update_start[b] == v.update_start[a] + U[a]).only_enforce_if(at_boundary)
    m.add(v.cpu_end == sum(U.values())).only_enforce_if(at_boundary)
    if isinstance(v.grads, int):
        return
    early = {i: _option_sum(v, i, opts, lambda o: o.owned * c.early_piece(o)) for i, opts in enumerate(c.layer_options)}
    landing = landing_order(c.n_layers)
    for i in landing:
        host = _not(v.on_device[i])
        if _is(host, 0):
            continue
        m.add(v.update_start[i] >= v.end[f"grad[L{i}]"]).only_enforce_if(_lits(v.grads, host))
        if i == E:
            m.add(v.update_start[i] >= v.end["grad[L0]"]).only_enforce_if(_lits(v.grads, host))
    for a, b in zip(landing, landing[1:]):
        m.add(v.update_start[b] >= v.update_start[a] + early[a]).only_enforce_if(v.grads)
    m.add(v.update_start[landing[0]] >= v.cpu_end - v.makespan).only_enforce_if(v.grads)
    m.add(v.cpu_end >= v.update_start[landing[-1]] + early[landing[-1]]).only_enforce_if(v.grads)


def _device_delay(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """The device's AdamW delays the forward's start (costs.device_update) by

        delay >= 0,  delay >= sum_{j <= k} U_j device_state[j] - F_<k     for every layer k that may be there

    (U_j: layer j's update on the device, F_<k: the forward before layer k); minimised, it is the
    largest (a layer k on the host adds nothing: its bound is that of the last one before it)."""
    c = data.costs
    capable = sorted(c.problem.device_capable)
    if not capable:
        return
    v.device_delay = m.new_int_var(0, c.device_update(capable), "device_delay")
    updated = 0
    for k in capable:
        updated += c.device_update_ticks[k] * v.on_device[k]
        m.add(v.device_delay >= updated - c.forward_before[k])


# -- constraints: the program ------------------------------------------------------------------------


def _presence(m: cp_model.CpModel, data: Data, v: Vars, op: Op):
    """The literal of an op's `when` (None: always there): offload -> offloads[i];
    sharded -> OR of route[g,sharded,*]; gpu -> OR of route[g,*,gpu]; order -> order[o];
    two atoms -> their AND."""
    c = data.costs
    lits = []
    if op.layer == c.epilogue_id and op.key.endswith(",head]") and c.epilogue_id in v.vocab:
        lits.append(v.vocab[c.epilogue_id])  # the head's second load: only where its table streams
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
        if i == 0:
            return c.prologue_fwd + (v.device_delay if v.device_delay is not None else 0)
        return c.blocks[i].fwd
    if op.kind == "epi":  # a streamed head recomputes its logits
        return c.epilogue + ((c.epilogue_streamed - c.epilogue) * v.vocab[i] if i in v.vocab else 0)
    if op.kind == "bwd":
        return c.prologue_bwd if i == 0 else sum(c.blocks[i].bwd[a] * v.act[(i, a)] for a in data.activations)
    if op.kind == "load":
        if op.phase == "bwd":
            return _option_sum(v, i, opts, lambda o: o.load_pieces * o.bwd_piece)
        return _option_sum(v, i, opts, lambda o: o.load_pieces * (o.fwd_piece_duplex if duplex else o.fwd_piece))
    if op.kind == "grad":
        return _option_sum(v, i, opts, lambda o: o.grad_pieces * o.grad_piece)
    if op.kind == "all_gather":
        return _option_sum(v, i, opts, lambda o: o.all_gather)
    if op.kind == "reduce_scatter":
        return _option_sum(v, i, opts, lambda o: o.reduce_scatter)
    if op.kind in ("offload", "reload"):
        ticks = c.blocks[i].offload if op.kind == "offload" else c.blocks[i].reload
        return sum(ticks[a] * v.act[(i, a)] for a in OFFLOADED if (i, a) in v.act)
    raise ValueError(op.kind)


def _load_schedule(data: Data, v: Vars, op: Op, duplex: bool = False, early: bool = False):
    """C of a chunkwise load: sum_o opt[L,o] C_o(p_o), p_o the (duplex) forward piece time; `early`: with
    the update's pieces at the backward's rate (costs.early_piece), over the options with the state on
    the host (a layer whose state is on the device waits for no CPU)."""
    c = data.costs
    opts = c.layer_options[op.layer]
    if early:
        opts = [o for o in opts if not o.on_device]
    return _option_sum(v, op.layer, opts, lambda o: o.load_schedule(
        o.fwd_piece_duplex if duplex else o.fwd_piece, c.early_piece(o) if early else None))


def _chunkwise(m: cp_model.CpModel, data: Data, v: Vars, op: Op, e, own: list, duplex: bool = False) -> None:
    """A chunkwise load's end after its chunks' updates: e >= R_L + C at the step boundary; with the
    gradients streamed, e >= R_L - makespan + C' where the layer is on the host (its update ran in the
    step before: note [early updates])."""
    at_boundary = _lits(_not(v.grads))
    m.add(e >= v.update_start[op.layer] + _load_schedule(data, v, op, duplex)).only_enforce_if(own + at_boundary)
    host = _not(v.on_device[op.layer])
    if isinstance(v.grads, int) or _is(host, 0):
        return
    m.add(e >= v.update_start[op.layer] - v.makespan + _load_schedule(data, v, op, duplex, early=True)
          ).only_enforce_if(own + _lits(v.grads, host))


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
                _chunkwise(m, data, v, op, e, own)
            if op.kind == "load" and op.phase == "fwd" and v.any_offload is not None:
                both = own + [v.any_offload]
                m.add(e >= s + _duration(data, v, op, duplex=True)).only_enforce_if(both)
                _chunkwise(m, data, v, op, e, both, duplex=True)
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


def memory_constraints(m: cp_model.CpModel, costs: ProblemCosts, window: int, v: Vars, cap,
                       host: bool = True) -> None:
    """Device memory at every compute position x (footprint.py) within `cap` (the budget, or a
    variable when minimising the peak), and (`host`) host memory within its budgets:

        staging >= sum_o opt[L,o] staging_o                        for every layer L
        kept_i = kept_(i-1) + m saved_i act[i,keep]                 (blocks 1..i keep, prefix sum)
        unstash_i = act[i,recompute_offload] AND (act[i-1,recompute] + act[i-1,recompute_offload])
        base(x) + staging + sum_L state_L device_state[L] + kept_(j(x)) + sum_T delta_T(x) streamed[T]
            + sum_i (offload and recompute terms(x) act[i,.]) - sum_i (unstashed terms(x) unstash_i) <= cap
        left = G sum_i,a m host_i,a act[i,a] + sum_L,o copy_L,o opt[L,o]
                                       (one host's G ranks' offloaded activations and kept copies)
        left <= G host_offload_bytes,  fixed + left <= host_budget_bytes        (where given)

    where blocks 1..j(x) hold kept activations at x (j = i at block i's forward and backward),
    state_L the device bytes of layer L's optimizer state, delta_T(x) what streaming table T changes of
    the base (footprint.vocab_memory_deltas: its resident parameters and gradient, its chunks' slots,
    the head's working set), host_i,a the bytes an offloaded policy a
    of block i puts on the host per micro-batch, and fixed the host RAM of the placement (`host_bytes`)."""
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
    device_state = sum(b * v.on_device[i] for i, b in costs.device_state_layer_bytes.items())
    lits = [v.on_device[i] for i in costs.device_state_layer_bytes]
    if any(_is(lit, 1) for lit in lits):  # an update's fp32 piece, where any layer keeps its state here
        device_state += costs.device_update_piece_bytes
    elif any(not isinstance(lit, int) for lit in lits):
        any_on = m.new_bool_var("device_state[any]")
        for lit in lits:
            if not isinstance(lit, int):
                m.add_implication(lit, any_on)
        device_state += costs.device_update_piece_bytes * any_on
    deltas = vocab_memory_deltas(costs, window, program.compute_keys) if costs.vocab_groups else {}
    for x, t in enumerate(terms(costs, window, program.compute_keys)):
        expr = t.base_bytes + v.staging + device_state
        expr += sum(delta[x] * v.vocab[group[0]] for group, delta in deltas.items() if delta[x])
        expr += prefix[t.keep_upto]
        for policies, pairs in (((OFFLOAD,), t.offload), (RECOMPUTED, t.recompute)):
            expr += sum(b * v.act[(i, p)] for p in policies for i, b in pairs if (i, p) in v.act)
        expr -= sum(b * v.unstash[i] for i, b in t.unstashed if i in v.unstash)
        m.add(expr <= cap)
    p = costs.problem
    if host and p.host_offload_bytes is not None:
        m.add(host_left(costs, v) <= p.ranks_per_host * p.host_offload_bytes)
    if host and p.host_budget_bytes is not None:
        m.add(host_bytes(m, costs, v) <= p.host_budget_bytes)


def host_left(costs: ProblemCosts, v: Vars) -> cp_model.LinearExpr:
    """One host's offloaded activations, kept delivery copies and kept gradients that could stream
    (costs.host_left_bytes)."""
    G, m_batches = costs.problem.ranks_per_host, costs.problem.micro_batches
    left = [(G * m_batches * b.host_bytes[a], v.act[(i, a)]) for i, b in costs.blocks.items() for a in OFFLOADED
            if (i, a) in v.act]
    left += [(o.copy_host_bytes, v.opt[(i, o.key)]) for i, opts in enumerate(costs.layer_options) for o in opts
             if o.copy_host_bytes]
    left += [(costs.streamable_grads[i], lit) for i, lit in v.grads_kept.items()]
    return sum(b * lit for b, lit in left)


def host_bytes(m: cp_model.CpModel, costs: ProblemCosts, v: Vars) -> cp_model.LinearExpr:
    """One host's RAM as the model counts it: the fixed part of the placement (costs.HostFixed),

        control + sum_L (host_L + (device_L - host_L) device_state[L]) + staging chunk + load lean,
        chunk >= chunk_L (1 - device_state[L]),  lean >= device_state[L]       (one rank)

    (chunk and lean at least their true values; the least is the true one), plus `host_left`."""
    f, capable = costs.host_fixed, costs.problem.device_capable
    host_only = [n for i, n in enumerate(f.chunk_numel) if i not in capable]
    if v.host_chunk is None:
        optional = [i for i in sorted(costs.problem.device_state_optional) if f.chunk_numel[i] > max(host_only, default=0)]
        if optional:
            v.host_chunk = m.new_int_var(max(host_only, default=0), max(f.chunk_numel[i] for i in optional), "host_chunk")
            for i in optional:
                m.add(v.host_chunk >= f.chunk_numel[i] * (1 - v.on_device[i]))
        else:
            v.host_chunk = max(host_only, default=0)
        if not f.load_staging or not capable:
            v.host_lean = 0
        elif costs.problem.device_state:
            v.host_lean = 1
        else:
            v.host_lean = m.new_bool_var("host_lean")
            for i in sorted(capable):
                m.add_implication(v.on_device[i], v.host_lean)
    state = f.control + sum(f.host[i] + (f.device[i] - f.host[i]) * v.on_device[i] for i in range(len(f.host)))
    return state + f.staging_per_numel * v.host_chunk + f.load_staging * v.host_lean + host_left(costs, v)


def _makespan(m: cp_model.CpModel, data: Data, v: Vars) -> None:
    """makespan >= end of every GPU lane's last op; at the step boundary makespan >= cpu_end (note [step
    boundary] in oracles/timeline.py; with the gradients streamed, updates may end in the next step);
    makespan >= lower_bound (valid for such decisions; it helps the search's bound)."""
    for lane in GPU_LANES:
        m.add(v.makespan >= v.lane_end[lane])
    at_boundary = _lits(_not(v.grads))
    m.add(v.makespan >= v.cpu_end).only_enforce_if(at_boundary)
    m.add(v.makespan >= lower_bound(data.costs)).only_enforce_if(at_boundary)
    if not isinstance(v.grads, int):
        m.add(v.makespan >= lower_bound(data.costs, early=True))


# -- hints and read back ------------------------------------------------------------------------------


def _decision_values(costs: ProblemCosts, v: Vars, d: Decisions):
    """(literal, value) of every decision variable for decisions `d` (hints, pinning)."""
    out = [(lit, d.layers[i].activation == a) for (i, a), lit in v.act.items()]
    chosen = {i: (x.chunks, x.delivery, x.reduction, x.host_copy, x.on_device, x.activation == STREAMED)
              for i, x in enumerate(d.layers)}
    out += [(lit, chosen[i] == key) for (i, key), lit in v.opt.items()]
    out += [(lit, d.layers[i].on_device) for i, lit in v.on_device.items() if not isinstance(lit, int)]
    out += [(lit, d.layers[group[0]].activation == STREAMED) for group in costs.vocab_groups
            for lit in (v.vocab[group[0]],)]
    first = {"prologue": 0, "blocks": 1, "epilogue": costs.epilogue_id}
    out += [(lit, (d.layers[first[g]].delivery, d.layers[first[g]].reduction) == (dl, r))
            for (g, dl, r), lit in v.route.items()]
    out += [(lit, d.update_order == o) for o, lit in v.order.items()]
    if not isinstance(v.grads, int):
        out.append((v.grads, d.grads_streamed))
    out += [(lit, not d.grads_streamed and not d.layers[i].on_device) for i, lit in v.grads_kept.items()]
    return out


def _read_back(solver: cp_model.CpSolver, costs: ProblemCosts, v: Vars, window: int, acts, orders) -> Decisions:
    layers = []
    for i, opts in enumerate(costs.layer_options):
        key = next(o.key for o in opts if solver.boolean_value(v.opt[(i, o.key)]))
        if i in costs.blocks:
            act = next(a for a in acts if solver.boolean_value(v.act[(i, a)]))
        else:
            act = STREAMED if key[5] else RESIDENT
        layers.append(LayerChoice(key[0], act, key[1], key[2], key[3], key[4]))
    order = next((o for o in orders if solver.boolean_value(v.order[o])), orders[0]) if v.order else orders[0]
    d = Decisions(window, order, tuple(layers))
    if not isinstance(v.grads, int) and solver.boolean_value(v.grads):
        d = d.with_streamed_gradients(costs.n_layers)
    return d


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
    if costs.problem.grads_streamable:
        # the steady state of streamed gradients is cyclic (R_L - makespan): bounds alone propagate it
        # poorly, the LP of the enforced linear constraints proves it at once
        p.linearization_level = 2


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
    _streamed_gradients(m, costs, v)
    _offload_flag(m, data, v)
    _update_lanes(m, data, v)
    _device_delay(m, data, v)
    _program_order(m, data, v)
    memory_constraints(m, costs, window, v, budget_bytes)
    _makespan(m, data, v)
    m.minimize(v.makespan)
    return m, data, v


def _placement_values(costs: ProblemCosts, v: Vars, d: Decisions):
    """(variable, value) of the placement's auxiliary variables under `d`: the device's delay, the host's
    largest chunk and lean flag."""
    on_device, f = d.device_state, costs.host_fixed
    out = [(v.device_delay, costs.device_update(on_device))] if v.device_delay is not None else []
    if not isinstance(v.host_chunk, (int, type(None))):
        out.append((v.host_chunk, max((n for i, n in enumerate(f.chunk_numel) if i not in on_device), default=0)))
    if not isinstance(v.host_lean, (int, type(None))):
        out.append((v.host_lean, bool(on_device)))
    return out


def _update_starts(costs: ProblemCosts, d: Decisions, cf: closed_form.ClosedForm) -> list[int]:
    """R_L of every layer (in layer order) under `d`: the closed form's; with the gradients streamed, a
    layer whose state is on the device (not on the CPU lanes) where the lanes reach it in landing order."""
    if not d.grads_streamed:
        return [cf.update_start[i] for i in range(costs.n_layers)]
    R, t = {}, max(0, cf.cpu_end - cf.makespan)
    for i in landing_order(costs.n_layers):
        R[i] = cf.update_start.get(i, t)
        t = R[i] + (costs.option_of(i, d.layers[i]).owned * costs.early_piece(costs.option_of(i, d.layers[i]))
                    if i in cf.update_start else 0)
    return [R[i] for i in range(costs.n_layers)]


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
    values += [(lit, cf.present.get(key, False)) for key, lit in v.both.items()]
    U = closed_form.lane_update_ticks(costs, d)
    values.append((v.head_extra, U[costs.epilogue_id] if d.update_order == HEAD_FIRST else 0))
    values += [(var, R) for var, R in zip(v.update_start.values(), _update_starts(costs, d, cf))]
    # an op of the model that d's program lacks (a resident head's second load): absent, at the end
    # of the lane's op before it
    at = {}
    for lane in GPU_LANES:
        previous = 0
        for op in data.ops[lane]:
            previous = at[op.key] = cf.end.get(op.key, previous)
    values += [(v.start[k], cf.start.get(k, at[k])) for k in v.start] + [(v.end[k], cf.end.get(k, at[k]))
                                                                           for k in v.end]
    kept = 0
    for i in sorted(costs.blocks):
        if d.layers[i].activation == KEEP:
            kept += costs.problem.micro_batches * costs.blocks[i].saved_bytes
        if not isinstance(v.kept[i], int):
            values.append((v.kept[i], kept))
    values.append((v.staging, max(costs.option_of(i, c).staging_bytes
                                  for i, c in enumerate(d.layers))))
    values += _placement_values(costs, v, d)
    values += [(v.cpu_end, cf.cpu_end), (v.makespan, cf.makespan)]
    for var, value in values:
        m.add_hint(var, int(value))
    return cf.makespan


def solve_window(costs: ProblemCosts, window: int, budget_bytes: int, hint: Decisions | None,
                 deterministic_time: float, cutoff: int | None = None) -> WindowResult:
    """Minimise the makespan for one window. FEASIBLE (a time limit was reached) is a normal result.

    The search starts from the hint (decisions that fit, completed with their timing) and is
    bounded by its makespan and by `cutoff` (ticks: the fastest step found so far, in any window);
    a window with nothing that fast ends NOT_FASTER, its bound the cutoff + 1. (Bounding by the hint
    alone, CP-SAT may stall short of proving a window whose optimum is well below it: a 3-block
    model on 2 hosts stayed FEASIBLE after 30 deterministic seconds that it proves in 0.01 with the
    cutoff.) Decisions other than the hint's are then pinned and re-solved (`pinned`): that
    objective must equal their simulated step time (asserted), and is reported.
    """
    upper = closed_form.evaluate(costs, hint).makespan if hint is not None and costs.options.hints else None
    horizon = min((t for t in (upper, cutoff) if t is not None), default=None)
    m, data, v = build_model(costs, window, budget_bytes, horizon)
    if upper is not None:
        _complete_hint(m, costs, data, v, hint)
    solver = cp_model.CpSolver()
    _parameters(solver, costs, deterministic_time)
    t0 = time.perf_counter()
    status = solver.solve(m)
    wall = time.perf_counter() - t0
    decisions = objective = None
    label = STATUS[status]
    bound = int(round(solver.best_objective_bound)) if status != cp_model.INFEASIBLE else None
    if status == cp_model.INFEASIBLE and horizon is not None and horizon != upper:
        label, bound = NOT_FASTER, data.horizon + 1  # the horizon: the cutoff, or the lower bound above it
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        decisions = _read_back(solver, costs, v, window, data.activations, data.orders)
        if upper is not None and decisions == hint:
            objective = upper
        else:
            objective, _ = pinned(costs, decisions, budget_bytes)
        if status == cp_model.OPTIMAL:
            assert objective == int(round(solver.objective_value)), (objective, solver.objective_value)
    proto = m.proto
    return WindowResult(window, label, decisions, objective, bound, wall, solver.deterministic_time,
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


def _memory_model(costs: ProblemCosts, window: int, symmetric: bool = True):
    """The decisions alone (no timing), for a model of memory only: model, variables.

    Memory does not see which of two layers alike in every byte (their options' staging and kept
    copies, their state's device and host bytes, their largest chunk) keeps its state on the device,
    so of such layers the earlier ones are placed there first (device_state[a] >= device_state[b] for
    a < b): one placement of each count, where the blocks of a model (most of them alike) would give
    CP-SAT every permutation to refute (not where the placement is given: `symmetric` False)."""
    m = cp_model.CpModel()
    v = _decision_variables(m, costs, costs.options.activations, costs.options.update_orders)
    _one_choice_each(m, costs, v)
    _routes_per_group(m, costs, v)
    _streamed_gradients(m, costs, v)
    f, alike = costs.host_fixed, {}
    for i in sorted(costs.problem.device_state_optional) if symmetric else ():
        key = (tuple((o.key, o.staging_bytes, o.copy_host_bytes) for o in costs.layer_options[i]),
               costs.device_state_layer_bytes[i], f.host[i], f.device[i], f.chunk_numel[i])
        if key in alike:
            m.add(v.on_device[alike[key]] >= v.on_device[i])
        alike[key] = i
    return m, v


def _solve_memory_model(costs: ProblemCosts, m: cp_model.CpModel, v: Vars, window: int, deterministic_time: float):
    """Solve a memory model (minimised): (status, the value found, the proven bound, decisions), or None
    where no decisions satisfy it."""
    solver = cp_model.CpSolver()
    _parameters(solver, costs, deterministic_time, presolve=True)
    solver.parameters.linearization_level = 2
    status = solver.solve(m)
    if status == cp_model.INFEASIBLE:
        return None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"the memory model ended {STATUS[status]} (window {window})")
    orders = costs.options.update_orders
    d = _read_back(solver, costs, v, window, costs.options.activations, orders)
    found = int(round(solver.objective_value))
    bound = found if status == cp_model.OPTIMAL else int(math.ceil(solver.best_objective_bound))
    return found, bound, replace(d, update_order=FORWARD_ORDER if FORWARD_ORDER in orders else orders[0])


def minimum_peak(costs: ProblemCosts, window: int, deterministic_time: float = 30.0, *,
                 host: bool = True, on_device=None) -> tuple[int, int, Decisions] | None:
    """The smallest peak device memory over every decision with this window within host memory (`host`
    False: whatever the host takes): (the least peak found, the proven lower bound, decisions reaching
    that peak); None where no decisions fit the host. Both are the same where CP-SAT proves the
    minimum (OPTIMAL); a model it cannot close in `deterministic_time` gives its best peak and its bound.
    Optimizer state goes to the device only where the host budget needs it there, or (`on_device`, a
    set of layers) exactly there.

    A host budget that binds the offloaded activations and inputs makes the model a knapsack: the LP
    relaxation with its cuts (linearization level 2) proves it in hundredths of a second on Qwen3-14B
    (one H200, 118 GiB of host RAM), where level 1 stopped 1-5% short after 30 deterministic seconds."""
    m, v = _memory_model(costs, window, symmetric=on_device is None)
    keys = build_lanes(costs.n_blocks, window, False).compute_keys
    deltas = vocab_memory_deltas(costs, window, keys) if costs.vocab_groups else {}
    upper = max(o.staging_bytes for opts in costs.layer_options for o in opts) + costs.device_state_bytes(
        costs.device_state_layer_bytes) + sum(
        t.base_bytes + sum(b for _, b in t.keep + t.offload + t.recompute) for t in terms(costs, window, keys)) + sum(
        max(0, b) for delta in deltas.values() for b in delta)
    peak = m.new_int_var(0, upper, "peak")
    memory_constraints(m, costs, window, v, peak, host=host)
    if on_device is not None:
        for i, lit in v.on_device.items():
            if not isinstance(lit, int):
                m.add(lit == int(i in on_device))
    m.minimize(peak)
    return _solve_memory_model(costs, m, v, window, deterministic_time)


def minimum_host(costs: ProblemCosts, window: int, budget_bytes: int,
                 deterministic_time: float = 30.0) -> tuple[int, Decisions] | None:
    """The least host RAM of one host (`host_bytes`: the fixed part of the placement, offloaded
    activations, kept delivery copies) over every decision with this window within the device budget:
    (the least found, decisions taking it); None where nothing fits the device budget. The leanest
    host layout may keep optimizer state on the device (with one rank its layers take no host RAM)."""
    m, v = _memory_model(costs, window)
    memory_constraints(m, costs, window, v, budget_bytes, host=False)
    m.minimize(host_bytes(m, costs, v))
    found = _solve_memory_model(costs, m, v, window, deterministic_time)
    return None if found is None else (found[0], found[2])


def search(costs: ProblemCosts, budget_bytes: int, start: Decisions | None, *, window: int,
           deterministic_time: float, cutoff: int | None = None) -> tuple[Found | None, WindowResult]:
    """`solve_window` as a search strategy, hinted with `start` and looking no slower than `cutoff`: what
    it found (None: nothing within its time or the cutoff), and its WindowResult (status, bound,
    statistics), which the plan reports either way."""
    result = solve_window(costs, window, budget_bytes, start, deterministic_time, cutoff)
    if result.decisions is None:
        return None, result
    return Found("cp-sat", result.decisions, simulate(costs, result.decisions, all_ranks=False)), result
