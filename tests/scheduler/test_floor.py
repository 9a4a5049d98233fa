"""The floor of the step under a budget (search/floor.py): never above any plan that fits, with early and
streamed updates included, and tighter than the compute alone where memory and PCIe bind."""

from dataclasses import replace

import pytest
import torch

from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.scheduler.decisions import SolverOptions, landing_order
from slidedp.scheduler.oracles.brute_force import all_decisions, brute_force
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.search import cpsat
from slidedp.scheduler.search.floor import lanes_floor
from slidedp.scheduler.solve import solve, solve_plan
from tests.models import make_model
from tests.scheduler.test_solver import CASES, SLOW_CASES, make_costs, peak


def budgets(costs) -> list[int]:
    """The least peak, halfway, and the largest peak of every decision."""
    peaks = sorted({peak(costs, d) for d in all_decisions(costs)})
    return [peaks[0], (peaks[0] + peaks[-1]) // 2, peaks[-1]]


# the brute force of these takes 5-12 s each on 2 cores: run with -m slow
SLOW_HERE = SLOW_CASES | {"delivery copies under a host limit", "optimizer state placed, 2 ranks sharded",
                          "gradients streamed or kept, 2 ranks, either reduction"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_HERE else c for c in CASES])
def test_the_floor_is_never_above_the_fastest_plan_that_fits(case):
    costs = make_costs(case)
    for budget in budgets(costs):
        best = brute_force(costs, budget)
        if best is not None:
            assert lanes_floor(costs, budget) <= best[0], budget


def with_every_update(case) -> ProblemCosts:
    """The case's problem with streamed updates and early updates allowed (one rank)."""
    costs = make_costs(case)
    problem = replace(costs.problem, streamed_updates=True, early_host_bytes=1 << 62)
    return ProblemCosts(problem, costs.options)


def every_update(costs, d):
    """d with each number of its host layers streamed at the step boundary, their updates after the
    boundary or, the rest, as their gradients land (early updates)."""
    hosts = [i for i in d.order(costs.n_layers) if i in costs.streamed_layers and not d.layers[i].on_device]
    for k in range(len(hosts) + 1):
        streamed = replace(d, streamed=tuple(hosts[:k]))
        yield streamed
        early = tuple(i for i in landing_order(costs.n_layers) if i in hosts[k:])
        if early and not d.grads_streamed:
            yield replace(streamed, early_order=early)


@pytest.mark.parametrize("case, tighter_somewhere", [
    ("optimizer state placed, one rank", True), pytest.param("chunks per layer", True, marks=pytest.mark.slow),
    ("vocabulary streamed or not, optimizer state placed", True), ("activations, windows, orders", False)])
def test_no_plan_with_streamed_or_early_updates_steps_under_the_floor(case, tighter_somewhere):
    """The floor holds for every decision with streamed and early updates too (which brute force and the
    CP-SAT model leave out); where the state is large beside the compute, it is tighter than the compute
    alone at a small budget."""
    costs = with_every_update(case)
    tighter = False
    for budget in budgets(costs):
        floor = lanes_floor(costs, budget)
        fastest = None
        for d in all_decisions(costs):
            for e in every_update(costs, d):
                sim = simulate(costs, e, all_ranks=False)
                if costs.fits(e, sim.peak_bytes, budget):
                    assert floor <= sim.makespan, (budget, e)
                    fastest = sim.makespan if fastest is None else min(fastest, sim.makespan)
        assert fastest is not None
        tighter |= floor > cpsat.lower_bound(costs, streamed=True)
    assert tighter == tighter_somewhere


def test_a_plan_bounded_by_the_floor_says_so():
    """The solver's lower bound holds the floor; a plan that streams updates (which CP-SAT's model leaves out)
    and is bounded by it names it in its gap words."""
    costs = with_every_update("optimizer state placed, one rank")
    budget = budgets(costs)[0]
    floor = lanes_floor(costs, budget)
    assert solve(costs, budget).lower_bound >= floor > cpsat.lower_bound(costs, streamed=True)
    graph = build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.float32)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["cpu"], precision="fp32", micro_batches=2,
                      streamed_updates=True, options=SolverOptions(streamed_layers=1))
    sv = plan.solver
    assert plan.streamed_updates and sv["status"] == "FEASIBLE" and sv["best_bound_s"] == sv["lower_bound_s"]
    assert "the busiest of the compute on the GPU, the two copy directions and a CPU lane" in sv["gap_explained"]
