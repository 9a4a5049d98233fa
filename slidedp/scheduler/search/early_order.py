"""Early updates in the plan: which host layers the CPU updates during the backward, in which order.

The gradients land in the order last block, ..., first block, prologue, epilogue (the executor
sends the resident layers' gradients after the prologue's backward, the head's tied use included);
the next step loads them in its update order (prologue, blocks, epilogue). The CPU takes the first
m layers as they land, then the rest in the order the next step loads them (the simulator's note [early updates] lays that out in steady
state): m = all keeps the CPU busy through the backward but makes the next forward wait for the
prologue's update; a smaller m lets the forward start sooner. The best m is found by simulation.

The other way (Problem.grads_streamable), every host layer's gradient streamed into its update as it
lands (m = all, in place: no spare state, no gradient in host RAM), is a decision of the CP-SAT model
(cpsat.py, Decisions.grads_streamed, Decisions.with_streamed_gradients).
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import Decisions, landing_order  # noqa: F401 (landing_order: re-exported)
from slidedp.scheduler.oracles.timeline import Simulation, simulate
from slidedp.scheduler.search.found import Found


def early_order(costs: ProblemCosts, d: Decisions, landed_first: int) -> tuple[int, ...]:
    """The first `landed_first` host layers in landing order, then the others in the order the next
    step loads them (d's update order); layers with their state on the device, or whose update is
    streamed through it (d.streamed), are not in it."""
    host = set(range(costs.n_layers)) - d.device_state - set(d.streamed)
    first = [i for i in landing_order(costs.n_layers) if i in host][:landed_first]
    return tuple(first) + tuple(i for i in d.order(costs.n_layers) if i in host and i not in first)


def best_early(costs: ProblemCosts, d: Decisions) -> tuple[Decisions, Simulation] | None:
    """`d` with its best early order (its updates write a spare, or in place: Problem.early_in_place),
    where it fits; None: not allowed, no host layer, or `d` streams its gradients (a decision of the
    CP-SAT model, kept)."""
    if d.grads_streamed:
        return None
    return _spare_early(costs, d, costs.n_layers - len(d.device_state) - len(d.streamed))


def _spare_early(costs: ProblemCosts, d: Decisions, n: int) -> tuple[Decisions, Simulation] | None:
    """`d` with the early order of the fastest step whose updates write a spare (taken back if the
    gradient is not finite), where the spare state fits (none in place: Problem.early_in_place)."""
    # the spare state shares the host RAM left beside the host state with d's offloaded activations
    # and the delivery copies and gradients it keeps
    limit = costs.early_host_bytes(d)
    every = replace(d, early_order=early_order(costs, d, n))  # every early order writes the spare of all of them
    if limit is None or n == 0 or costs.spare_bytes(every) + costs.host_left_bytes(d) > limit:
        return None
    tried: dict[int, tuple[Decisions, Simulation]] = {}

    def at(m: int):
        if m not in tried:
            e = replace(d, early_order=early_order(costs, d, m))
            tried[m] = e, simulate(costs, e, all_ranks=False)
        return tried[m][1].makespan

    # the makespan is about unimodal in m: a coarse sweep, then the neighbours of the best
    for m in sorted({round(n * k / 8) for k in range(9)}):
        at(m)
    step = max(1, n // 8)
    while step > 1:
        best = min(tried, key=lambda m: (tried[m][1].makespan, m))
        step = max(1, step // 2)
        for m in (best - step, best + step):
            if 0 <= m <= n:
                at(m)
    best = min(tried, key=lambda m: (tried[m][1].makespan, m))
    return tried[best]


def search(costs: ProblemCosts, budget_bytes: int, start: Decisions) -> Found | None:
    """`start` with its best early order, as a search strategy (None: not allowed, or no host layer)."""
    found = best_early(costs, start)
    return None if found is None else Found("early updates", *found)
