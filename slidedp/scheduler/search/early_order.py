"""Early updates in the plan: which host layers the CPU updates during the backward, in which order.

The gradients land in the order last block, ..., first block, prologue, epilogue (the executor
sends the resident layers' gradients after the prologue's backward, the head's tied use included);
the next step loads them in its update order (prologue, blocks, epilogue). The CPU takes the first
m layers as they land, then the rest in the order the next step loads them (the simulator's note [early updates] lays that out in steady
state): m = all keeps the CPU busy through the backward but makes the next forward wait for the
prologue's update; a smaller m lets the forward start sooner. The best m is found by simulation.

Where the problem allows it (Problem.grads_streamable) the other way is compared: every layer's
gradient streamed into its update as it lands (m = all, in place), which needs no spare state and
keeps no gradient in host RAM.
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.costmodel import memory as mem
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import GPU, Decisions
from slidedp.scheduler.oracles.timeline import Simulation, simulate
from slidedp.scheduler.search.found import Found


def landing_order(n_layers: int) -> tuple[int, ...]:
    """Layer ids in the order their gradients reach the host within a pass."""
    return tuple(range(n_layers - 2, -1, -1)) + (n_layers - 1,)


def early_order(costs: ProblemCosts, d: Decisions, landed_first: int) -> tuple[int, ...]:
    """The first `landed_first` host layers in landing order, then the others in the order the next
    step loads them (d's update order); layers with their state on the device, or whose update is
    streamed through it (d.streamed), are not in it."""
    host = set(range(costs.n_layers)) - d.device_state - set(d.streamed)
    first = [i for i in landing_order(costs.n_layers) if i in host][:landed_first]
    return tuple(first) + tuple(i for i in d.order(costs.n_layers) if i in host and i not in first)


def spare_bytes(costs: ProblemCosts, d: Decisions) -> int:
    """Host bytes of the spare fp32 master and moments of every host layer the CPU updates
    (page-aligned, as the host state lays them out: costmodel.memory.host_spare_bytes)."""
    g = costs.problem.graph
    skip = d.device_state | set(d.streamed)
    return sum(mem.host_spare_bytes(layer.numel) for layer in g.layers if layer.id not in skip)


def best_early(costs: ProblemCosts, d: Decisions) -> tuple[Decisions, Simulation] | None:
    """`d` with its best early order, or with its gradients streamed into the update (every host
    layer as it lands, in place: neither spare nor gradient in host RAM), whichever is faster and
    fits; None: neither allowed (or no host layer)."""
    n = costs.n_layers - len(d.device_state) - len(d.streamed)
    found = [e for e in (_streamed_gradients(costs, d, n), _spare_early(costs, d, n)) if e is not None]
    return min(found, key=lambda e: e[1].makespan) if found else None


def _streamed_gradients(costs: ProblemCosts, d: Decisions, n: int) -> tuple[Decisions, Simulation] | None:
    """`d` with every host layer's gradient streamed into its update (Problem.grads_streamable)."""
    if not costs.problem.grads_streamable or n == 0 or d.streamed:
        return None
    host = set(range(costs.n_layers)) - d.device_state
    if costs.problem.world_size > 1 and any(d.layers[i].reduction != GPU for i in host):
        return None  # the CPUs sum the ranks' gradients into a host gradient
    e = replace(d, early_order=early_order(costs, d, n), grads_streamed=True)
    return e, simulate(costs, e, all_ranks=False)


def _spare_early(costs: ProblemCosts, d: Decisions, n: int) -> tuple[Decisions, Simulation] | None:
    """`d` with the early order of the fastest step whose updates write a spare (taken back if the
    gradient is not finite), where the spare state fits."""
    # the spare state shares the host RAM left beside the host state with d's offloaded activations
    # and the delivery copies and gradients it keeps
    d = replace(d, grads_streamed=False)
    limit = costs.early_host_bytes(d)
    if limit is None or n == 0 or spare_bytes(costs, d) + costs.host_left_bytes(d) > limit:
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
    if found is None:
        return None
    return Found("gradients streamed into the update" if found[0].grads_streamed else "early updates", *found)
