"""The program-order simulator: the cost model's definition of a step, and the solver's oracle.

Given a problem's costs and one complete set of decisions, it lays out every op of one step on
every lane of every rank, piece by piece, in program order (program.py): each op starts at
max(its lane is free, every op it depends on has ended), and lasts its duration in ticks
(costs.py). The step time is the makespan. The CP-SAT model encodes exactly this computation,
so its objective for some decisions equals `simulate(...).makespan` for them.

Note [step boundary]. The step starts at the instant the previous step's boundary is reached:
every gradient of the previous step is on the host (its last D2H has landed, so the global
gradient norm and the non-finite check are known) and every op of the previous step has ended.
From t = 0 the CPU lanes apply the previous step's AdamW update, chunk by chunk in the update
order; the forward's load of chunk c of layer L waits for that chunk's update. The step ends
(its makespan) when its last op ends: the prologue's backward, the last gradient copy, the last
collective (the CPU updates all end earlier: each one gates a load of this step). The next step
begins there, so in steady state the step period is exactly this makespan, and the update of the
last layer is counted in the step that uses it.

Note [early updates]. With `d.early_order` (one rank, no clipping: backend/runtime/early_updates.py; or
streamed gradients, d.grads_streamed, on any number of ranks, each its own chunks) there
is no step boundary. The CPU lane runs the host layers' updates in that order, each once its
gradient has landed in this step; the step ends when its last GPU or copy op ends, and updates still
running then belong to the next step: there, the CPU lane is busy until the carried part ends, and
the forward load of a chunk may not start before its update ends. The steady state is a fixed
point: lay out the step with the carry of the previous layout (first none), until the carry repeats.
The updates run beside the backward's copies both ways, at hardware.cpu_adamw_backward_fraction of
the CPU's AdamW rate.

Note [streamed updates]. The layers in `d.streamed` are updated on the devices at the step
boundary, each chunk by its owner, piece by piece (costs.streamed_pieces): each piece goes up on
the owner's H2D lane, then is updated and goes down on its D2H lane; a piece waits for the slot of
the piece two before it on that rank to be down (two slots). They head both lanes, before any load
of the step (every rank's are laid out, whatever `all_ranks`), and the forward load of a chunk waits
for its last piece to be down. They are not on the CPU lanes.

Note [lockstep]. Ranks run the same GPU program. A collective waits for its input on every
rank. Shared host resources (root-complex links, host DRAM, CPU cores) are charged as shares:
when one rank copies, all W do (costmodel/ops.py), so each op's duration already includes the
contention of the W ranks. With W ranks a layer moves in a multiple of W chunks and chunk c of
the layer at update position p is updated by rank (p + c) mod W: every CPU lane does the same
work, so all ranks' timelines come out identical (the simulator computes each one anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import (
    CPU, GPU, OFFLOAD, OFFLOADED, RECOMPUTED, REPLICATED, SHARDED, Decisions, landing_order,
)
from slidedp.scheduler.oracles.critical_path import longest_chain
from slidedp.scheduler.problem.footprint import Footprint, evaluate
from slidedp.scheduler.problem.lanes import (
    COLLECTIVE, COMPUTE, CPU_UPDATE, D2H, H2D, Op, Lanes, build_lanes,
)


@dataclass(frozen=True)
class OpTime:
    """One op of rank 0, all its pieces: first start, last end, and the time it occupied its lane."""

    key: str
    lane: str
    kind: str
    layer: int
    start: int
    end: int
    busy: int


@dataclass(frozen=True)
class Event:
    rank: int
    lane: str
    name: str
    layer: int
    chunk: int
    start: int
    end: int


@dataclass(frozen=True)
class Simulation:
    makespan: int  # ticks: the predicted step time
    tick_s: float
    footprint: Footprint  # device memory per rank over program order
    pinned_host_bytes: tuple[int, ...]  # all ranks, at each compute position
    compute_starts: tuple[int, ...]  # rank 0, ticks, by compute position
    ops: dict  # key -> OpTime, rank 0
    lane_busy: dict  # lane -> ticks, rank 0 (cpu_update: its busiest rank)
    events: tuple[Event, ...] = ()
    critical_path: tuple[int, ...] = ()  # indices into `events`: the chain that sets the makespan (critical_path.py)

    @property
    def step_s(self) -> float:
        return self.makespan * self.tick_s

    @property
    def peak_bytes(self) -> int:
        return self.footprint.peak_bytes


def check_decisions(costs: ProblemCosts, d: Decisions) -> None:
    """Refuse decisions outside the problem's options (a wrong plan must not be simulated)."""
    g = costs.problem.graph
    if len(d.layers) != costs.n_layers:
        raise ValueError(f"decisions for {len(d.layers)} layers, the graph has {costs.n_layers}")
    if d.window not in costs.windows():
        raise ValueError(f"window {d.window} is not among {costs.windows()}")
    if d.update_order not in costs.options.update_orders:
        raise ValueError(f"update order {d.update_order!r} is not among {costs.options.update_orders}")
    for i, (layer, c) in enumerate(zip(g.layers, d.layers)):
        costs.option_of(i, c)
        allowed = costs.options.activations if layer.kind == "block" else (costs.edge_activation(i),)
        if c.activation not in allowed:
            raise ValueError(f"layer {i} ({layer.kind}): activation {c.activation!r} is not among {allowed}")
    blocks = {(c.delivery, c.reduction) for c in d.layers[1:-1]}
    if len(blocks) != 1:
        raise ValueError(f"every block must share one delivery and reduction route, got {sorted(blocks)}")
    if d.grads_streamed:
        n, on_device = costs.n_layers, d.device_state
        landing = tuple(i for i in landing_order(n) if i not in on_device)
        cpu_reduced = costs.problem.world_size > 1 and any(c.reduction == CPU for i, c in enumerate(d.layers)
                                                           if i not in on_device)
        if not costs.problem.grads_streamable or d.streamed or d.early_order != landing or cpu_reduced:
            raise ValueError("streamed gradients need a problem that allows them (Problem.grads_streamable), no "
                             "streamed updates, every host layer updated as it lands (early_order) and, with "
                             "several ranks, reduced on the GPUs")
    if d.streamed:
        if not costs.problem.streamed_updates:
            raise ValueError("streamed updates are not allowed for this problem (Problem.streamed_updates)")
        bad = [i for i in d.streamed if i not in costs.streamed_layers or i in d.early_order
               or d.layers[i].on_device]
        if bad or len(set(d.streamed)) != len(d.streamed):
            raise ValueError(f"streamed layers must be distinct host layers with parameters and no early "
                             f"update, got {d.streamed}")


def condition(d: Decisions):
    """The truth of a program op's `when` atoms under decisions `d`."""
    def holds(atom) -> bool:
        what = atom[0]
        if what == "offload":
            return d.layers[atom[1]].activation in OFFLOADED
        if what == "sharded":
            return d.layers[atom[1]].delivery == SHARDED
        if what == "gpu":
            return d.layers[atom[1]].reduction == GPU
        if what == "order":
            return d.update_order == atom[1]
        raise ValueError(atom)
    return lambda op: all(holds(a) for a in op.when)


EARLY_ITERATIONS = 40  # layouts tried for the steady state of early updates (note [early updates])


def simulate(costs: ProblemCosts, d: Decisions, *, record: bool = False, all_ranks: bool = True) -> Simulation:
    """Lay out one step (in steady state). `all_ranks=False` lays out the GPU lanes of rank 0 only
    (with every rank's CPU lane), which gives the same makespan by note [lockstep], faster.
    Where the tables that stream are a decision, the costs of d's choice (ProblemCosts.variant)."""
    costs = costs.variant(d)
    check_decisions(costs, d)
    if d.early_order and costs.problem.world_size != 1 and not d.grads_streamed:
        raise ValueError("early updates are for one rank (several: only streamed gradients)")
    return _layout(costs, d, record, all_ranks)


def _layout(costs: ProblemCosts, d: Decisions, record: bool, all_ranks: bool) -> Simulation:
    """One step's layout. With early updates, the steady state of note [early updates]: the pieces
    are laid out again with the carry of the layout before (the ticks into the step at which each
    (layer, chunk)'s update and the CPU lane's work end; first none) until the carry repeats, at most
    EARLY_ITERATIONS times; only the pieces' release times change between layouts."""
    W, N = costs.problem.world_size, costs.n_blocks
    prog: Lanes = build_lanes(N, d.window, W > 1, costs.head_reload)
    present = condition(d)
    order = d.order(costs.n_layers)
    opt = [costs.option_of(i, c) for i, c in enumerate(d.layers)]
    any_offload = any(c.activation in OFFLOADED for c in d.layers)

    # Pieces: parallel lists indexed by piece id.
    rank_of, lane_of, name_of, layer_of, chunk_of, dur, key_deps, piece_deps = [], [], [], [], [], [], [], []
    carried: dict[int, tuple[int, int]] = {}  # early updates: a load piece -> its (layer, chunk), released by the carry
    queues: dict[tuple[int, str], list[int]] = {}
    last_piece: dict[tuple[int, str], int] = {}
    op_pieces: dict[str, list[int]] = {}  # rank 0 only
    update_piece: dict[tuple[int, int], int] = {}

    def add(rank, lane, name, layer, chunk, ticks, deps=(), pdeps=(), key=None):
        # `name` is (format, layer, chunk), formatted only when events are recorded
        pid = len(dur)
        rank_of.append(rank), lane_of.append(lane), name_of.append(name), layer_of.append(layer)
        chunk_of.append(chunk), dur.append(ticks), key_deps.append(deps), piece_deps.append(pdeps)
        queues.setdefault((rank, lane), []).append(pid)
        if key is not None:
            last_piece[(rank, key)] = pid
            if rank == 0:
                op_pieces.setdefault(key, []).append(pid)
        return pid

    owned: dict[tuple[int, int], list[int]] = {}
    for r in range(W):
        for p, layer in enumerate(order):
            mine = owned.setdefault((layer, r), [])
            for c in range(opt[layer].chunks):
                if costs.owner(p, c) == r:
                    mine.append(c)
    early = bool(d.early_order)
    streamed = set(d.streamed)
    down_pieces: dict[int, list[int]] = {r: [] for r in range(W)}  # each rank's streamed pieces down, in order
    for layer in d.streamed:
        chunks = costs.streamed_pieces[(layer, opt[layer].chunks)]
        for r in range(W):
            downs = down_pieces[r]
            for c in owned[(layer, r)]:
                for up_ticks, down_ticks in chunks[c] if c < len(chunks) else ():
                    slot = (downs[-2],) if len(downs) >= 2 else ()
                    up = add(r, H2D, ("state up L{} c{}", layer, c), layer, c, up_ticks, (), slot,
                             key=f"state_up[L{layer}]")
                    downs.append(add(r, D2H, ("update+state down L{} c{}", layer, c), layer, c, down_ticks, (),
                                     (up,), key=f"state_down[L{layer}]"))
            # a load waits for the whole layer (the device's event, or every rank's mark): by
            # note [lockstep] each rank's last piece of it ends at the same time as the owner's
            for c in owned[(layer, r)] if downs else ():
                update_piece[(layer, c)] = downs[-1]
    for r in range(W):
        for layer in (d.early_order if early else order):
            if layer in streamed:
                continue
            # its whole gradient, as the executor waits (it sends the epilogue's after the prologue's)
            g = r if all_ranks else 0  # by note [lockstep] rank 0's copies land when every rank's do
            deps = ((g, f"grad[L{layer}]"),) + (((g, "grad[L0]"),) if layer == N + 1 else ()) if early else ()
            for c in owned[(layer, r)]:
                ticks = costs.early_piece(opt[layer]) if early else opt[layer].update_piece
                update_piece[(layer, c)] = add(r, CPU_UPDATE, ("update L{} c{}", layer, c), layer, c, ticks, deps,
                                               key=f"update[L{layer}]")

    def own_chunks(layer: int, rank: int) -> list[int]:
        return owned[(layer, rank)]

    gpu_ranks = range(W) if all_ranks else range(1)
    for r in gpu_ranks:
        for lane, lane_ops in prog.lanes.items():
            for op in lane_ops:
                if present(op):
                    _add_op(op, r, len(gpu_ranks), d, costs, opt, any_offload, own_chunks, update_piece, add,
                            carried if early else None)

    # Resolve op-level dependencies to the last piece of the op (absent ops are no dependency).
    deps: list[tuple[int, ...]] = []
    for pid in range(len(dur)):
        resolved = list(piece_deps[pid])
        for dep_rank, dep_key in key_deps[pid]:
            q = last_piece.get((dep_rank, dep_key))
            if q is not None:
                resolved.append(q)
        deps.append(tuple(resolved))

    if not early:
        release: dict[int, int] = {}
        start, end = _list_schedule(queues, deps, dur)
        makespan = max(end, default=0)
    else:  # the step ends with its GPU and copy work; later updates carry over (note [early updates])
        cpu_first = [q[0] for r in range(W) if (q := queues.get((r, CPU_UPDATE)))]
        gpu_pieces = [p for p in range(len(dur)) if lane_of[p] != CPU_UPDATE]
        cpu_pieces = [p for r in range(W) for p in queues.get((r, CPU_UPDATE), ())]
        carry: tuple[dict, int] = ({}, 0)
        for _ in range(EARLY_ITERATIONS):
            release = {pid: carry[0][key] for pid, key in carried.items() if key in carry[0]}
            release.update((pid, carry[1]) for pid in cpu_first)
            start, end = _list_schedule(queues, deps, dur, release)
            makespan = max((end[p] for p in gpu_pieces), default=0)
            update_end = {key: end[p] for key, p in update_piece.items()}
            cpu_end = max((end[p] for p in cpu_pieces), default=0)
            nxt = ({k: e - makespan for k, e in update_end.items() if e > makespan}, max(0, cpu_end - makespan))
            if nxt == carry:
                break
            carry = nxt

    footprint = evaluate(costs, d, prog.compute_keys)
    compute_ids = queues[(0, COMPUTE)]
    compute_starts = tuple(start[pid] for pid in compute_ids)
    ops = {}
    for key, pids in op_pieces.items():
        ops[key] = OpTime(key, lane_of[pids[0]], key.split("[")[0], layer_of[pids[0]],
                          min(start[p] for p in pids), max(end[p] for p in pids), sum(dur[p] for p in pids))
    lane_busy = {lane: sum(dur[p] for p in queues.get((0, lane), ())) for lane in (COMPUTE, H2D, D2H, COLLECTIVE)}
    lane_busy[CPU_UPDATE] = max(sum(dur[p] for p in queues.get((r, CPU_UPDATE), ())) for r in range(W))
    events, critical = (), ()
    if record:
        events = tuple(Event(rank_of[p], lane_of[p], name_of[p][0].format(*name_of[p][1:]), layer_of[p],
                             chunk_of[p], start[p], end[p]) for p in range(len(dur)))
        critical, length = longest_chain(queues.values(), deps, dur, release,
                                         (lambda p: lane_of[p] != CPU_UPDATE) if early else (lambda p: True))
        assert length == makespan, (length, makespan)  # the module docstring of critical_path.py
    pinned = _pinned_host(costs, d) if record else ()
    return Simulation(makespan, costs.scale.tick_s, footprint, pinned, compute_starts, ops, lane_busy, events, critical)


def _add_op(op: Op, r: int, gpu_ranks: int, d: Decisions, costs: ProblemCosts, opt, any_offload, own_chunks,
            update_piece, add, carried=None) -> None:
    """The pieces of one program op on rank r (its deps: same rank, or every rank for collectives).
    `carried` (early updates): where each chunkwise load piece is noted with its (layer, chunk), which
    the previous step's update of that chunk may hold back (note [early updates])."""
    layer = op.layer
    o = opt[layer]
    if op.lane == COLLECTIVE:
        deps = tuple((q, k) for k in op.deps for q in range(gpu_ranks))
    else:
        deps = tuple((r, k) for k in op.deps)
    if op.kind in ("fwd", "epi", "bwd"):
        if op.kind == "epi":
            ticks, name = costs.epilogue, "epilogue L{}"
        elif layer == 0:
            ticks = costs.prologue_fwd_ticks(d) if op.kind == "fwd" else costs.prologue_bwd
            name = op.kind + " L{}"
        elif op.kind == "fwd":
            ticks, name = costs.blocks[layer].fwd, "fwd L{}"
        else:
            act = d.layers[layer].activation
            ticks = costs.blocks[layer].bwd[act]
            name = "recompute+bwd L{}" if act in RECOMPUTED else "bwd L{}"
        add(r, COMPUTE, (name, layer), layer, -1, ticks, deps, key=op.key)
    elif op.kind == "load":
        chunks = range(o.chunks) if o.delivery == REPLICATED else own_chunks(layer, r)
        if op.phase == "fwd":
            piece = o.fwd_piece_duplex if any_offload else o.fwd_piece
        else:
            piece = o.bwd_piece
        name = "load L{} c{}" if op.phase == "fwd" else "reload L{} c{}"
        for c in chunks:
            if carried is None:  # the step boundary: this step's first pieces are the updates
                pid = add(r, H2D, (name, layer, c), layer, c, piece, deps,
                          (update_piece[(layer, c)],) if op.chunkwise else (), key=op.key)
            else:  # early updates: the previous step's update of the chunk, if it carried over
                streamed = op.chunkwise and layer in d.streamed  # updated at this step's boundary
                pid = add(r, H2D, (name, layer, c), layer, c, piece, deps,
                          (update_piece[(layer, c)],) if streamed else (), key=op.key)
                if op.chunkwise:
                    carried[pid] = (layer, c)
    elif op.kind in ("reload", "offload"):
        act = d.layers[layer].activation
        what = "activations" if act == OFFLOAD else "input"
        b = costs.blocks[layer]
        lane, ticks = (H2D, b.reload[act]) if op.kind == "reload" else (D2H, b.offload[act])
        add(r, lane, (f"{op.kind} {what} L{{}}", layer), layer, -1, ticks, deps, key=op.key)
    elif op.kind == "grad":
        chunks = range(o.chunks) if o.reduction == CPU else own_chunks(layer, r)
        for c in chunks:
            add(r, D2H, ("grad L{} c{}", layer, c), layer, c, o.grad_piece, deps, key=op.key)
    elif op.kind == "all_gather":
        add(r, COLLECTIVE, ("all-gather L{}", layer), layer, -1, o.all_gather, deps, key=op.key)
    elif op.kind == "reduce_scatter":
        add(r, COLLECTIVE, ("reduce-scatter L{}", layer), layer, -1, o.reduce_scatter, deps, key=op.key)
    else:
        raise ValueError(op.kind)


def _list_schedule(queues, deps, dur, release=None):
    """Each lane runs its ops in order; an op starts at max(lane free, its dependencies' ends, its
    release time if it has one)."""
    release = release or {}
    n = len(dur)
    start, end = [0] * n, [-1] * n
    heads = {q: 0 for q in queues}
    free = {q: 0 for q in queues}
    remaining = n
    while remaining:
        progress = False
        for q, ids in queues.items():
            i = heads[q]
            t_free = free[q]
            while i < len(ids):
                pid = ids[i]
                t = max(t_free, release.get(pid, 0))
                for dep in deps[pid]:
                    e = end[dep]
                    if e < 0:
                        break
                    if e > t:
                        t = e
                else:
                    start[pid] = t
                    t_free = end[pid] = t + dur[pid]
                    i += 1
                    remaining -= 1
                    progress = True
                    continue
                break
            heads[q], free[q] = i, t_free
        if not progress:
            stuck = [ids[heads[q]] for q, ids in queues.items() if heads[q] < len(ids)]
            raise RuntimeError(f"the program deadlocks: {len(stuck)} lanes wait forever")
    return start, end


def _pinned_host(costs: ProblemCosts, d: Decisions) -> tuple[int, ...]:
    """Pinned host bytes (all ranks) at each compute position: the weights' delivery copy, the
    gradient landing buffers (one per rank with the CPU reduction), offloaded activations and inputs."""
    W, N, m = costs.problem.world_size, costs.n_blocks, costs.problem.micro_batches
    g = costs.problem.graph
    static = 0
    for layer, c in zip(g.layers, d.layers):
        static += layer.numel * costs.elem * (1 + (W if c.reduction == CPU else 1))
    out = []
    for x in range(2 * N + 3):
        held = sum(W * m * costs.blocks[i].host_bytes[d.layers[i].activation] for i in costs.blocks
                   if d.layers[i].activation in OFFLOADED and i < x < 2 * N + 2 - i)
        out.append(static + held)
    return tuple(out)

