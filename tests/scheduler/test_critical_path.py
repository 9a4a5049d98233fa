"""The critical path of a simulated step: the chain of pieces that sets the step time."""

import random
from dataclasses import replace

import pytest

from slidedp.costmodel.hardware import PRESETS
from slidedp.report.html import render_html
from slidedp.scheduler.decisions import Problem, SolverOptions
from slidedp.scheduler.oracles.critical_path import longest_chain
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.plan import Plan
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.search import baselines
from slidedp.scheduler.search.early_order import early_order
from slidedp.scheduler.solve import fixed_plan
from tests.scheduler.graphs import synthetic_graph
from tests.scheduler.test_simulator import costs_for, random_decisions


def test_the_longest_chain_follows_lanes_and_dependencies():
    """compute: a(2) b(1); h2d: x(5); b waits for x. The step is x then b (6 ticks), not a then b
    (3: lane order alone) nor a alone; without the dependency it would be x alone (5)."""
    a, b, x = 0, 1, 2
    ticks = (2, 1, 5)
    assert longest_chain([(a, b), (x,)], ((), (x,), ()), ticks) == ((x, b), 6)
    assert longest_chain([(a, b), (x,)], ((), (), ()), ticks) == ((x,), 5)
    # a release time counts as waiting at the start; pieces that may not end the step lead nowhere
    assert longest_chain([(a, b), (x,)], ((), (), ()), ticks, release={a: 4}) == ((a, b), 7)
    assert longest_chain([(a, b), (x,)], ((), (), ()), ticks, ends_step=lambda p: p != x) == ((a, b), 3)


def _check_chain(sim):
    """Each piece on the path starts when the one before it ends (or at 0); durations add up to the step."""
    path = [sim.events[i] for i in sim.critical_path]
    assert path and path[-1].end == sim.makespan
    assert path[0].start == 0 or path[0].lane == "h2d"  # a load may be released by a carried-over update
    for before, after in zip(path, path[1:]):
        assert after.start == before.end, (before, after)
    return sum(e.end - e.start for e in path)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_critical_path_is_as_long_as_the_step(world_size):
    costs = costs_for(4, world_size, chunk_multiples=(1, 2))
    rng = random.Random(world_size)
    for _ in range(20):
        sim = simulate(costs, random_decisions(costs, rng), record=True)
        assert _check_chain(sim) == sim.makespan
        assert simulate(costs, random_decisions(costs, rng)).critical_path == ()  # only when recorded


@pytest.mark.parametrize("k, early", [(0, True), (2, False), (2, True)])
def test_the_critical_path_with_early_and_streamed_updates(k, early):
    """With early updates the step ends with its last GPU or copy piece, and a forward load may start
    late for an update carried over from the step before: the path's durations and that wait add up
    to the step."""
    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    costs = ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, 1, streamed_updates=True,
                                 early_host_bytes=1 << 50 if early else None), SolverOptions())
    d = baselines.uniform(costs, window=2, activation="recompute")
    d = replace(d, streamed=d.order(costs.n_layers)[:k])
    if early:
        d = replace(d, early_order=early_order(costs, d, 2))
    sim = simulate(costs, d, record=True)
    first = sim.events[sim.critical_path[0]]
    assert _check_chain(sim) + first.start == sim.makespan
    assert all(sim.events[i].lane != "cpu_update" for i in sim.critical_path[-1:])


def test_the_plan_keeps_names_and_shows_its_critical_path(tmp_path):
    """plan_for stores the path as event names that find the same events in the timeline again,
    after a JSON round trip; the summary's line adds up to the predicted step; the HTML report
    outlines exactly those events and lists the runs off the compute lane as exposed time."""
    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    plan = fixed_plan(graph, lambda costs, budget: baselines.uniform(costs, window=2, activation="recompute"),
                      method="uniform", budget_bytes=1 << 40, hardware=PRESETS["h100-sxm"], world_size=2,
                      precision="bf16", micro_batches=1)
    events = plan.explanation.critical_events()
    assert plan.critical_path and [e.name for e in events] == list(plan.critical_path)
    assert sum(plan.explanation.critical_lanes_s().values()) == pytest.approx(plan.predicted["step_s"], rel=1e-9)
    assert events[-1].end_s == pytest.approx(plan.predicted["step_s"], rel=1e-12)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and again.explanation.critical_events() == events
    line = next(line for line in plan.summary().splitlines() if "critical path" in line)
    assert line.startswith(f"  critical path: {len(events)} ops, ") and "the lanes that set the step" in line
    lanes = line.split(" ops, ", 1)[1].split(": the lanes")[0].split(", ")
    assert sum(float(part.split()[-2]) for part in lanes) == pytest.approx(plan.predicted["step_s"] * 1e3, abs=0.1 * len(plan.explanation.critical_lanes_s()))
    html = render_html(plan)
    assert html.count(" critical\"") == len(events)
    assert "Critical path: the operations that set the step" in html
    exposed = [e for e in events if e.lane != "compute"]
    assert exposed and exposed[0].name in html
    # a plan without a path (saved before it, or schedule only) shows none
    bare = render_html(plan.replace(critical_path=()))
    assert " critical\"" not in bare and "Critical path" not in bare and "critical path" not in \
        plan.replace(critical_path=()).summary()
