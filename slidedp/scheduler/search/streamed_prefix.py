"""Streamed updates in the plan: which host layers the device updates at the step boundary.

The CPU's AdamW of every host layer bounds a step once the budget keeps little on the device: the
next forward waits for the first layers' updates, which come last (their gradients land last). The
link is idle in one direction or both at the boundary, so the device can take the first k host
layers of the update order off the CPU: their fp32 master and moments and their gradient go up,
AdamW runs there, and master, moments and the delivery copy come back down
(backend/runtime/streamed_updates.py; 14 bytes each way over PCIe per bf16 parameter, against the CPU's 28
bytes of host DRAM traffic). The CPU updates the rest (after the boundary, or as their gradients land with early
updates). The best k is found by simulation (scheduler/oracles/timeline.py, note [streamed updates]).
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import Decisions
from slidedp.scheduler.search.early_order import best_early
from slidedp.scheduler.oracles.timeline import Simulation, simulate
from slidedp.scheduler.search.found import Found


def candidates(costs: ProblemCosts, d: Decisions) -> tuple[int, ...]:
    """Host layers with parameters, in update order: the streamed ones are a prefix of these."""
    return tuple(i for i in d.order(costs.n_layers) if i in costs.streamed_layers and not d.layers[i].on_device)


def best_streamed(costs: ProblemCosts, d: Decisions, budget_bytes: int
                  ) -> tuple[Decisions, Simulation, dict[int, float]] | None:
    """`d` with the best number of streamed layers (early updates re-chosen for the rest when `d`
    has them), its simulation and every k tried that fits with its step [s]; None: not allowed, no
    host layer, or nothing fits.
    costs.options.streamed_layers fixes k. The streamed updates' slots need room: when none fits
    beside d's weight window, the narrower windows the options allow are tried, widest first, until
    one streams faster than d without streaming."""
    if not costs.problem.streamed_updates:
        return None
    found = _best_streamed_at(costs, d, budget_bytes)
    if costs.options.streamed_layers is not None:
        return found
    for window in sorted((w for w in costs.windows() if w < d.window), reverse=True):
        if found is not None and found[0].streamed:
            break
        narrower = _best_streamed_at(costs, replace(d, window=window), budget_bytes)
        faster = narrower is not None and (found is None or narrower[1].makespan < found[1].makespan)
        if faster and narrower[0].streamed:
            found = narrower
    return found


def _best_streamed_at(costs: ProblemCosts, d: Decisions, budget_bytes: int
                      ) -> tuple[Decisions, Simulation, dict[int, float]] | None:
    """best_streamed for d's own window."""
    hosts = candidates(costs, d)
    if not hosts:
        return None
    base = replace(d, early_order=(), streamed=(), grads_streamed=False)
    early = bool(d.early_order)
    tried: dict[int, tuple[Decisions, Simulation] | None] = {}

    def at(k: int) -> float:
        if k not in tried:
            e = d if k == 0 and d.grads_streamed else replace(base, streamed=hosts[:k])  # none: d as decided
            found = best_early(costs, e) if early else None
            e, sim = found if found is not None else (e, simulate(costs, e, all_ranks=False))
            tried[k] = (e, sim) if costs.fits(e, sim.peak_bytes, budget_bytes) else None
        return tried[k][1].makespan if tried[k] is not None else float("inf")

    n = len(hosts)
    fixed = costs.options.streamed_layers
    if fixed is not None:
        if fixed > n:
            raise ValueError(f"streamed_layers={fixed}, but the plan has {n} host layers with parameters")
        at(fixed)
    else:
        # about unimodal in k: a coarse sweep, then the neighbours of the best
        for k in sorted({round(n * j / 8) for j in range(9)}):
            if at(k) == float("inf") and k > 0:  # the slots do not fit (their bytes do not depend on k)
                break
        step = max(1, n // 8)
        while step > 1:
            best = min(tried, key=lambda k: (at(k), k))
            step = max(1, step // 2)
            for k in (best - step, best + step):
                if 0 <= k <= n:
                    at(k)
    best = min(tried, key=lambda k: (at(k), k))
    if tried[best] is None:
        return None
    e, sim = tried[best]
    tick = costs.scale.tick_s
    return e, sim, {k: at(k) * tick for k in sorted(tried) if tried[k] is not None}


def search(costs: ProblemCosts, budget_bytes: int, start: Decisions) -> Found | None:
    """`best_streamed` as a search strategy; `tried` holds every k that fits with its step [s]."""
    found = best_streamed(costs, start, budget_bytes)
    return None if found is None else Found("streamed updates", found[0], found[1], found[2])
