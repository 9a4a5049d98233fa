"""Baseline schedules: fixed rules, no search. They return `Decisions` like the solver does (and
`solve.plan_for` turns any of them into the same Plan type); they seed the CP-SAT search as
hints, and the solver's plan is never slower than any of them that fits.

Common to all: the fewest chunks (one per rank), replicated delivery and CPU reduction (unless the
options force another route: `ProblemCosts.default_route`), the forward update order, the delivery
copies kept (all made on load where they do not fit the host budget), the optimizer state on the
device only where the problem fixes it there (or as given), and the widest of windows 2 then 1 that fits.
"""

from __future__ import annotations

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import (
    FORWARD_ORDER, KEEP, ON_LOAD, RECOMPUTE, Decisions, LayerChoice,
)
from slidedp.scheduler.problem.footprint import evaluate
from slidedp.scheduler.problem.lanes import build_lanes
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.search.found import Found


def uniform(costs: ProblemCosts, *, window: int, activation: str, chunk_multiple: int | None = None,
            route: tuple[str, str] | None = None, order: str | None = None, on_device=None) -> Decisions:
    """Every block with the same activation policy, every layer with the same chunks and route
    (None: costs.default_route); the optimizer state of `on_device` on the device (None: the layers
    the problem fixes there)."""
    W = costs.problem.world_size
    route = route or costs.default_route
    k = W * (chunk_multiple or min(costs.options.chunk_multiples))
    on_device = costs.problem.device_state if on_device is None else frozenset(on_device)
    layers = tuple(LayerChoice(k, activation if i in costs.blocks else costs.edge_activation(i), route[0], route[1],
                               on_device=i in on_device)
                   for i in range(costs.n_layers))
    order = order or (FORWARD_ORDER if FORWARD_ORDER in costs.options.update_orders else costs.options.update_orders[0])
    d = Decisions(min(window, costs.n_blocks), order, layers)
    room = costs.host_room(d)
    if room is not None and costs.host_left_bytes(d, grads=False) > room:  # gradients that may stream do
        d = d.replace_layers(costs.copyable - on_device, host_copy=ON_LOAD)  # every copy made on load
    return d


def peak_bytes(costs: ProblemCosts, d: Decisions) -> int:
    return evaluate(costs, d, build_lanes(costs.n_blocks, d.window, False).compute_keys).peak_bytes


def _widest_fitting(costs: ProblemCosts, budget_bytes: int, activation: str, on_device=None) -> Decisions | None:
    windows = costs.windows()
    for window in [w for w in (2, 1) if w in windows] or list(windows):
        d = uniform(costs, window=window, activation=activation, on_device=on_device)
        if peak_bytes(costs, d) <= budget_bytes:
            return d
    return None


def recompute_all(costs: ProblemCosts, budget_bytes: int, on_device=None) -> Decisions | None:
    """Every block recomputes its forward before its backward (the least activation memory)."""
    return _widest_fitting(costs, budget_bytes, RECOMPUTE, on_device)


def keep_all(costs: ProblemCosts, budget_bytes: int) -> Decisions | None:
    """Every block keeps its saved activations on the device (no recompute), where it fits."""
    if KEEP not in costs.options.activations:
        return None
    return _widest_fitting(costs, budget_bytes, KEEP)


def greedy(costs: ProblemCosts, budget_bytes: int, on_device=None) -> Decisions | None:
    """From recompute-all, keep the blocks with the most recompute time saved per byte held
    (ties: the later block, whose activations live the shortest) while the budget allows."""
    base = recompute_all(costs, budget_bytes, on_device)
    if base is None or KEEP not in costs.options.activations:
        return base
    m = costs.problem.micro_batches

    def value(i: int) -> tuple[float, int]:
        b = costs.blocks[i]
        saved = b.bwd[RECOMPUTE] - b.bwd[KEEP]
        return (-saved / max(1, m * b.saved_bytes), -i)

    d = base
    for i in sorted(costs.blocks, key=value):
        trial = d.replace_layers([i], activation=KEEP)
        if peak_bytes(costs, trial) <= budget_bytes:
            d = trial
    return d


BASELINES = {"recompute-all": recompute_all, "keep-all": keep_all, "greedy": greedy}


def default_decisions(costs: ProblemCosts, budget_bytes: int) -> Decisions | None:
    """The fixed default schedule (`plan.default_plan`): one chunk per rank, every block recomputed."""
    return recompute_all(costs, budget_bytes)


def strategy(name: str):
    """The baseline rule `name` as a search strategy (it needs no starting point)."""
    rule = BASELINES[name]

    def search(costs: ProblemCosts, budget_bytes: int, start: Decisions | None = None) -> Found | None:
        d = rule(costs, budget_bytes)
        return None if d is None else Found(f"baseline:{name}", d, simulate(costs, d, all_ranks=False))

    return search
