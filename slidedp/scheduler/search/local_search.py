"""Local search over whole-group moves, each judged by the simulator: a strong starting point for
CP-SAT on large models, where the exact search has little time. Deterministic (steepest descent,
ties to the first move listed)."""

from __future__ import annotations

from dataclasses import replace

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import KEEP, KEPT, OFFLOAD, ON_LOAD, RECOMPUTE, RECOMPUTE_OFFLOAD, STREAMED, Decisions
from slidedp.scheduler.problem.footprint import evaluate
from slidedp.scheduler.oracles import closed_form
from slidedp.scheduler.problem.lanes import build_lanes
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.search import early_order, streamed_prefix
from slidedp.scheduler.search.found import Found


def score(costs: ProblemCosts, d: Decisions, budget_bytes: int) -> float:
    """Makespan in ticks, or infinity if `d` does not fit: closed_form (the simulator's number) for
    step-boundary decisions, the simulator itself for early or streamed updates (which closed_form
    does not model; infinity where it refuses a combination)."""
    if d.early_order or d.streamed:
        try:
            sim = simulate(costs, d, all_ranks=False)
        except (ValueError, KeyError):
            return float("inf")
        return sim.makespan if costs.fits(d, sim.peak_bytes, budget_bytes) else float("inf")
    keys = build_lanes(costs.n_blocks, d.window, False).compute_keys
    if not costs.fits(d, evaluate(costs, d, keys).peak_bytes, budget_bytes):
        return float("inf")
    return closed_form.evaluate(costs, d).makespan


def moves(costs: ProblemCosts, d: Decisions):
    """Neighbours of `d`: another window; the other update order; another route, or another chunk
    count, for a whole group (prologue, blocks, epilogue); every block to one policy, or the blocks of
    one policy to another; one more block kept or offloaded (the latest recomputed one); one fewer
    (the earliest); one more block's input offloaded (the earliest recomputed one); one fewer (the
    latest); where the placement of the optimizer state is a decision, one more layer's on the device
    (the first on the host), one fewer (the last on the device), the prologue's moved; where they may,
    the gradients streamed into the update, or kept. These include
    every alternative the plan's explanation compares (explain.py)."""
    blocks = sorted(costs.blocks)
    groups = {"prologue": [0], "blocks": blocks, "epilogue": [costs.epilogue_id]}
    W = costs.problem.world_size
    for w in costs.windows():
        if w != d.window:
            yield replace(d, window=w)
    for o in costs.options.update_orders:
        e = reordered(costs, d, o) if o != d.update_order else None
        if e is not None:
            yield e
    for ids in groups.values():
        current = d.layers[ids[0]]
        for delivery, reduction in costs.routes:
            if (delivery, reduction) != (current.delivery, current.reduction):
                yield d.replace_layers(ids, delivery=delivery, reduction=reduction)
        for mult in costs.options.chunk_multiples:
            if mult * W != current.chunks or any(d.layers[i].chunks != current.chunks for i in ids):
                yield d.replace_layers(ids, chunks=mult * W)
    copyable = [i for i in sorted(costs.variant(d).copyable) if not d.layers[i].on_device]  # as d streams its tables
    if copyable:  # every delivery copy kept, or made on load; one more block's made on load, one fewer
        for copy in costs.options.host_copies:
            if any(d.layers[i].host_copy != copy for i in copyable):
                yield d.replace_layers(copyable, host_copy=copy)
        kept = [i for i in blocks if i in copyable and d.layers[i].host_copy == KEPT]
        made = [i for i in blocks if i in copyable and d.layers[i].host_copy == ON_LOAD]
        if kept:
            yield d.replace_layers([kept[-1]], host_copy=ON_LOAD)
        if made:
            yield d.replace_layers([made[0]], host_copy=KEPT)
    for a in costs.options.activations:
        if any(d.layers[i].activation != a for i in blocks):
            yield d.replace_layers(blocks, activation=a)
    policies = sorted({d.layers[i].activation for i in blocks})
    for policy in policies if len(policies) > 1 else ():  # the blocks of one policy to another
        ids = [i for i in blocks if d.layers[i].activation == policy]
        for a in costs.options.activations:
            if a != policy:
                yield d.replace_layers(ids, activation=a)
    recomputed = [i for i in blocks if d.layers[i].activation == RECOMPUTE]
    for a in (KEEP, OFFLOAD, RECOMPUTE_OFFLOAD):
        if a not in costs.options.activations:
            continue
        held = [i for i in blocks if d.layers[i].activation == a]
        if a == RECOMPUTE_OFFLOAD:  # the input held longest (block 1's stays: plan.input_offloaded); back: the latest
            more, fewer = [i for i in recomputed if i >= 2][:1], held[-1:]
        else:  # the activations held shortest; back: the earliest
            more, fewer = recomputed[-1:], held[:1]
        if more:
            yield d.replace_layers(more, activation=a)
        if fewer:
            yield d.replace_layers(fewer, activation=RECOMPUTE)
    yield from device_state_moves(costs, d)
    if d.grads_streamed:  # the gradients kept to the step boundary, or streamed into the update
        yield replace(d, early_order=(), grads_streamed=False)
    elif costs.may_stream_gradients(d):
        yield d.with_streamed_gradients(costs.n_layers)


def device_state_moves(costs: ProblemCosts, d: Decisions):
    """Where the placement of the optimizer state is a decision: one more layer's on the device (the
    first of the blocks, then the epilogue, on the host), one fewer (the last on the device), the
    prologue's moved (delivery copies of layers moved to the device: kept, the only way there); d's
    streamed updates and early order laid out again for the host layers (`relaid`). A layer whose table
    streams keeps its state on the host."""
    optional = {i for i in costs.problem.device_state_optional if d.layers[i].activation != STREAMED}
    prologue = costs.problem.graph.prologue.id
    rest = [i for i in sorted(optional) if i != prologue]
    on, off = [i for i in rest if d.layers[i].on_device], [i for i in rest if not d.layers[i].on_device]
    moved = ([d.replace_layers(off[:1], on_device=True, host_copy=KEPT)] if off else []) + (
        [d.replace_layers(on[-1:], on_device=False)] if on else []) + (
        [d.replace_layers([prologue], on_device=not d.layers[prologue].on_device, host_copy=KEPT)]
        if prologue in optional else [])
    for e in moved:
        e = relaid(costs, d, e)
        if e is not None:
            yield e


def reordered(costs: ProblemCosts, d: Decisions, update_order: str) -> Decisions | None:
    """`d` with another update order (`relaid`)."""
    return relaid(costs, d, replace(d, update_order=update_order))


def relaid(costs: ProblemCosts, d: Decisions, e: Decisions) -> Decisions | None:
    """`e` (d with its update order or placement changed) with d's streamed updates still the first
    host layers of its update order and d's early order's tail (the layers not taken as they land) in
    it, every host layer where the gradients stream, as the searches that chose them lay them out
    (streamed_prefix.candidates, early_order.early_order); None when d's early order is not one of
    that form."""
    if d.streamed:
        e = replace(e, streamed=streamed_prefix.candidates(costs, e)[: len(d.streamed)])
    if d.early_order:
        m = next((m for m in range(len(d.early_order) + 1)
                  if early_order.early_order(costs, d, m) == d.early_order), None)
        if m is None:
            return None
        e = replace(e, early_order=early_order.early_order(costs, e, costs.n_layers if d.grads_streamed else m))
    return e


def improve(costs: ProblemCosts, start: Decisions, budget_bytes: int, *, max_evaluations: int = 200) -> Decisions:
    """Steepest descent from `start` (which must fit) until no move helps or the evaluations run out."""
    best, best_score = start, score(costs, start, budget_bytes)
    evaluations = 0
    while evaluations < max_evaluations:
        candidates = list(moves(costs, best))[: max_evaluations - evaluations]
        evaluations += len(candidates)
        scored = [(score(costs, d, budget_bytes), k) for k, d in enumerate(candidates)]
        if not scored:
            break
        value, k = min(scored)
        if value >= best_score:
            break
        best, best_score = candidates[k], value
    return best


def search(costs: ProblemCosts, budget_bytes: int, start: Decisions, *, name: str = "local-search") -> Found:
    """`improve` as a search strategy: steepest descent from `start`."""
    d = improve(costs, start, budget_bytes, max_evaluations=costs.options.local_search_evaluations)
    return Found(name, d, simulate(costs, d, all_ranks=False))


def changed(before: Decisions, after: Decisions) -> list[str]:
    """The decision families that differ between two decisions, in words."""
    out = [name for name, attr in (("window", "window"), ("update order", "update_order"),
                                   ("gradients streamed", "grads_streamed"))
           if getattr(before, attr) != getattr(after, attr)]
    for name, attr in (("chunks", "chunks"), ("activations", "activation"), ("delivery", "delivery"),
                       ("reduction", "reduction"), ("delivery copies", "host_copy"),
                       ("optimizer state on the device", "on_device")):
        if any(getattr(a, attr) != getattr(b, attr) for a, b in zip(before.layers, after.layers)):
            out.append(name)
    return out
