"""The CP-SAT solver against brute force over the simulator, the baselines, budgets, determinism."""

import itertools
import json
import re
from dataclasses import replace

import pytest
import torch

import slidedp
from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.scheduler.search import baselines, cpsat
from slidedp.scheduler.oracles import closed_form
from slidedp.scheduler.oracles.brute_force import all_decisions, brute_force
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import Decisions, LayerChoice, Problem, SolverOptions, landing_order
from slidedp.scheduler.problem.footprint import evaluate
from slidedp.scheduler.problem.lanes import build_lanes
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.explain import alternatives
from slidedp.scheduler.solve import _searches, solve, solve_plan
from tests.models import make_model
from tests.scheduler.graphs import synthetic_graph

GiB = 2**30
MiB = 2**20

# Small problems: <= 6 layers, <= 3 values per decision.
CASES = {
    "activations, windows, orders": dict(
        graph=lambda: synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0)), world_size=1, hardware="h100-sxm",
        options=dict(activations=("recompute", "keep", "offload"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "chunks per layer": dict(
        graph=lambda: synthetic_graph(3, block_numel=64 * 2**20), world_size=1, hardware="h200-sxm",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2, 4), windows=(2,),
                     update_orders=("forward",))),
    "routes for 2 ranks": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 3.0)), world_size=2, hardware="h100-sxm",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",))),
    "tiny llama, cpu device": dict(
        graph=lambda: build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.float32),
        world_size=1, hardware="cpu",
        options=dict(chunk_multiples=(1,), windows=(1, 2), update_orders=("forward", "head_first"))),
    "tiny tied gpt2, 3 ranks": dict(
        graph=lambda: build_layer_graph(make_model("gpt2", tied=True), batch_size=2, seq_len=16,
                                        compute_dtype=torch.bfloat16),
        world_size=3, hardware="h100-sxm",
        options=dict(activations=("recompute", "offload"), chunk_multiples=(1,), windows=(1, 3),
                     deliveries=("replicated", "sharded"), reductions=("cpu",), update_orders=("forward",))),
    "2 hosts x 2 ranks, no peer-to-peer": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 2.0, 1.0)), world_size=4, hardware="rtx4090",
        hosts=2, link_bytes_per_s=12.5e9,
        options=dict(activations=("recompute", "keep", "offload"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",))),
    "streamed vocabulary, 2 ranks without peer-to-peer": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 2.0, 1.0)), world_size=2, hardware="rtx4090",
        vocab_streamed=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "delivery copies under a host limit": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 2.0, 1.0)), world_size=1, hardware="h200-sxm",
        copies_on_load=True, host_offload_bytes=200 * 2**20,  # both tables' copies (125 MiB each) do not fit
        options=dict(activations=("recompute", "keep", "offload"), chunk_multiples=(1, 2), windows=(1, 2),
                     update_orders=("forward",))),
    "delivery copies, 2 hosts": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 2.0)), world_size=4, hardware="rtx4090",
        hosts=2, link_bytes_per_s=12.5e9, copies_on_load=True, host_offload_bytes=40 * 2**20,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",))),
    # every route for the streamed tables (the head's second load gathered again when sharded)
    "streamed vocabulary, 2 ranks with peer-to-peer": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 2.0)), world_size=2, hardware="h100-sxm",
        vocab_streamed=True,
        options=dict(activations=("recompute",), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "streamed vocabulary, 2 hosts x 2 ranks": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 2.0, 1.0)), world_size=4, hardware="rtx4090",
        hosts=2, link_bytes_per_s=12.5e9, vocab_streamed=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    # which tables stream a decision of the model (every allowed set: untied, each on its own; tied, both or
    # neither), with every route (the head's second load gathered again when sharded) and beside the
    # placement of the optimizer state (a table streams only with its layer's state on the host)
    "vocabulary streamed or not, one rank": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 0.5, 2.0), vocab=64000), world_size=1,
        hardware="h100-sxm", vocab_streamed="choice",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward", "head_first"), vocab_chunk_numel=16 * 2**20)),
    "vocabulary streamed or not, tied table, 2 ranks with peer-to-peer": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 2.0), tied=True), world_size=2, hardware="h100-sxm",
        vocab_streamed="choice",
        options=dict(activations=("recompute",), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "vocabulary streamed or not, optimizer state placed": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 0.5), vocab=64000), world_size=1, hardware="h200-sxm",
        vocab_streamed="choice", device_state="optional",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",), vocab_chunk_numel=16 * 2**20)),
    # the placement of every layer's optimizer state a decision (every set of layers on the device)
    "optimizer state placed, one rank": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 0.5, 2.0)), world_size=1, hardware="h200-sxm",
        device_state="optional",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "optimizer state placed, 2 ranks sharded": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 3.0)), world_size=2, hardware="h100-sxm",
        device_state="optional", device_state_sharded=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2), windows=(1, 2),
                     deliveries=("replicated", "sharded"), reductions=("cpu",), update_orders=("forward",))),
    "optimizer state placed, 2 ranks each a full copy": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 3.0)), world_size=2, hardware="h100-sxm",
        device_state="optional",
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     deliveries=("replicated",), reductions=("cpu", "gpu"), update_orders=("forward",))),
    # the host budget binds: the state of some layers must go to the device (no host RAM there, one
    # rank), or their delivery copies be made on load
    "optimizer state placed under a host budget": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 0.5, 2.0)), world_size=1, hardware="h200-sxm",
        device_state="optional", copies_on_load=True, host_budget="binding",
        options=dict(activations=("recompute", "keep", "offload"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",))),
    # the gradients kept to the step boundary or streamed into the update (Decisions.grads_streamed)
    "gradients streamed or kept, one rank": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 0.5, 2.0)), world_size=1, hardware="h200-sxm",
        grads_streamable=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2), windows=(1, 2),
                     update_orders=("forward", "head_first"))),
    "gradients streamed or kept, 2 ranks, either reduction": dict(
        graph=lambda: synthetic_graph(2, block_scale=(1.0, 3.0)), world_size=2, hardware="h100-sxm",
        grads_streamable=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1, 2), windows=(1, 2),
                     deliveries=("replicated", "sharded"), reductions=("cpu", "gpu"), update_orders=("forward",))),
    "gradients streamed or kept, optimizer state placed under a host budget": dict(
        graph=lambda: synthetic_graph(3, block_scale=(1.0, 0.5, 2.0)), world_size=1, hardware="h200-sxm",
        device_state="optional", copies_on_load=True, host_budget="binding", grads_streamable=True,
        options=dict(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                     update_orders=("forward",))),
}


def make_costs(case) -> ProblemCosts:
    c = CASES[case]
    graph = c["graph"]()
    vocab = frozenset({0, len(graph.layers) - 1}) if c.get("vocab_streamed") is True else frozenset()
    choices = tuple(graph.vocab_sets()) if c.get("vocab_streamed") == "choice" else ()
    placed = frozenset(layer.id for layer in graph.layers) if c.get("device_state") == "optional" else frozenset()
    problem = Problem(graph, PRESETS[c["hardware"]], c["world_size"], micro_batches=2,
                      hosts=c.get("hosts", 1), link_bytes_per_s=c.get("link_bytes_per_s", 0.0),
                      vocab_streamed=vocab, copies_on_load=c.get("copies_on_load", False),
                      host_offload_bytes=c.get("host_offload_bytes"), device_state_optional=placed,
                      device_state_sharded=c.get("device_state_sharded", False), vocab_choices=choices,
                      grads_streamable=c.get("grads_streamable", False))
    options = SolverOptions(**c["options"])
    problem = replace(problem, vocab_chunk_numel=options.vocab_chunk_numel)
    if c.get("host_budget") == "binding":  # halfway between the fixed host RAM of no state and all on the device
        fixed = ProblemCosts(problem, options).host_fixed
        problem = replace(problem, host_budget_bytes=(fixed.bytes(()) + fixed.bytes(placed)) // 2)
    return ProblemCosts(problem, options)


def peak(costs, d) -> int:
    return evaluate(costs, d, build_lanes(costs.n_blocks, d.window, False).compute_keys).peak_bytes


def binding_budget(costs) -> int:
    """Halfway between the smallest and the largest peak: some decisions fit, some do not."""
    peaks = [peak(costs, d) for d in all_decisions(costs)]
    return (min(peaks) + max(peaks)) // 2


# The multi-host streamed-vocabulary case's brute force takes about 7 s on 2 cores: run with -m slow.
SLOW_CASES = {"streamed vocabulary, 2 hosts x 2 ranks"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_solver_objective_equals_brute_force_and_beats_every_baseline(case):
    costs = make_costs(case)
    budget = binding_budget(costs)
    best, best_d = brute_force(costs, budget)
    # CP-SAT alone, no hint: the best window's objective is the brute-force optimum, proven
    results = [cpsat.solve_window(costs, w, budget, None, 30.0) for w in costs.windows()]
    assert all(r.status in ("OPTIMAL", "INFEASIBLE") for r in results)
    assert min(r.objective for r in results if r.objective is not None) == best
    # the whole planner: same optimum, never slower than a baseline that fits
    sol = solve(costs, budget)
    assert sol.makespan == best and sol.status == "OPTIMAL" and sol.bound == best
    assert peak(costs, sol.decisions) <= budget
    for name, make in baselines.BASELINES.items():
        d = make(costs, budget)
        if d is not None:
            assert sol.makespan <= simulate(costs, d).makespan, name


@pytest.mark.parametrize("case", ["activations, windows, orders", "routes for 2 ranks"])
def test_a_window_searched_below_a_cutoff_is_proven_not_faster(case):
    """Each window's fastest step within the budget by brute force: searched below it the window ends
    NOT_FASTER with that step as its bound; searched at it, the step is found and proven."""
    costs = make_costs(case)
    budget = binding_budget(costs)
    for w in costs.windows():
        per_window = replace(costs.options, windows=(w,))
        best, _ = brute_force(ProblemCosts(costs.problem, per_window), budget)
        below = cpsat.solve_window(costs, w, budget, None, 30.0, cutoff=best - 1)
        assert (below.status, below.best_bound, below.decisions) == ("NOT_FASTER", best, None)
        at = cpsat.solve_window(costs, w, budget, None, 30.0, cutoff=best)
        assert (at.status, at.objective, at.best_bound) == ("OPTIMAL", best, best)


def test_a_window_cp_sat_does_not_search_is_bounded_by_the_floor_and_said_so():
    """Proven: "optimal". With only the fastest heuristic's window searched (here for a model of any size),
    the others' bound is the analytical floor, which the plan's gap names with the window."""
    costs = make_costs("activations, windows, orders")
    budget = binding_budget(costs)
    proven = solve(costs, budget)
    assert proven.status == "OPTIMAL" and proven.gap_explained.startswith("optimal")
    one = solve(ProblemCosts(costs.problem, replace(costs.options, all_windows_up_to_blocks=0)), budget)
    assert one.status == "FEASIBLE" and one.bound == one.lower_bound == cpsat.lower_bound(costs) < one.makespan
    unsearched = int(re.search(r"window (\d+) was not searched by CP-SAT", one.gap_explained)[1])
    assert unsearched in costs.windows() and unsearched not in {r.window for r in one.windows}


def test_a_larger_budget_never_gives_a_slower_step():
    costs = make_costs("activations, windows, orders")
    peaks = sorted({peak(costs, d) for d in all_decisions(costs)})
    budgets = [peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1], peaks[-1] * 2]
    steps = [solve(costs, b).makespan for b in budgets]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


@pytest.mark.parametrize("case", ["activations, windows, orders", "routes for 2 ranks"])
def test_min_budget_is_exact(case):
    costs = make_costs(case)
    smallest = min(peak(costs, d) for d in all_decisions(costs))
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        solve(costs, 1)
    assert info.value.min_budget_bytes == smallest
    sol = solve(costs, smallest)
    assert peak(costs, sol.decisions) <= smallest
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        solve(costs, smallest - 1)
    assert info.value.min_budget_bytes == smallest and "bytes" in str(info.value)


def test_an_unproven_least_peak_refuses_below_its_bound_and_searches_the_gap(monkeypatch):
    """Where CP-SAT cannot prove the least peak in its time it gives its best peak and a lower bound:
    a budget below the bound is refused, one in the gap is searched (here nothing fits it: refused,
    naming the peak found), and one at the peak found plans."""
    costs = make_costs("activations, windows, orders")
    smallest = min(peak(costs, d) for d in all_decisions(costs))
    exact = cpsat.minimum_peak
    gap = 64 * MiB

    def unproven(costs, window, deterministic_time=30.0, **kw):
        found, bound, decisions = exact(costs, window, deterministic_time, **kw)
        assert found == bound == smallest  # proven on a problem this small
        return found, bound - gap, decisions

    monkeypatch.setattr(cpsat, "minimum_peak", unproven)
    for budget in (smallest - gap - 1, smallest - gap // 2):
        with pytest.raises(slidedp.InfeasibleBudgetError) as info:
            solve(costs, budget)
        assert info.value.min_budget_bytes == smallest
    sol = solve(costs, smallest)
    assert peak(costs, sol.decisions) <= smallest


def test_the_least_peak_under_a_binding_host_budget_is_proven():
    """A host budget with room for 7.5 of 30 blocks' inputs makes the least-peak model a knapsack: CP-SAT
    proves its minimum within one deterministic second (found == bound), with decisions peaking there
    that offload the 7 inputs the host holds."""
    inputs_bytes = 4 * 32 * MiB  # one block's input, 4 micro-batches
    costs = ProblemCosts(Problem(synthetic_graph(30), PRESETS["h200-sxm"], 1, micro_batches=4,
                                 host_offload_bytes=15 * inputs_bytes // 2), SolverOptions())
    found, bound, decisions = cpsat.minimum_peak(costs, costs.windows()[0], deterministic_time=1.0)
    assert found == bound == peak(costs, decisions)
    assert sum(c.activation == "recompute_offload" for c in decisions.layers) == 7


def test_min_budget_through_slidedp_plan():
    model = make_model("qwen3")
    kwargs = dict(batch_size=2, seq_len=16, precision="fp32", device="cpu")
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        slidedp.plan(model, 1000, **kwargs)
    smallest = info.value.min_budget_bytes
    plan = slidedp.plan(model, smallest, **kwargs)
    assert plan.peak_device_bytes <= smallest and plan.budget_bytes == smallest
    with pytest.raises(slidedp.InfeasibleBudgetError):
        slidedp.plan(model, smallest - 1, **kwargs)


def _json_without_wall_time(plan) -> str:
    data = plan.to_dict()
    data["explanation"]["solver"].pop("wall_s")  # the only field that measures the machine, not the problem
    return json.dumps(data, sort_keys=True)


# 9 blocks above all_windows_up_to_blocks=8: the large-model path (one CP-SAT model, for the best window)
@pytest.mark.parametrize("blocks, world_size, large_from", [(4, 1, 16), (9, 1, 8), pytest.param(24, 2, 16, marks=pytest.mark.slow)])
def test_identical_inputs_give_identical_plans(blocks, world_size, large_from):
    graph = synthetic_graph(blocks)
    options = SolverOptions(all_windows_up_to_blocks=large_from)
    plans = [solve_plan(graph, budget_bytes=12 * GiB, hardware=PRESETS["h100-sxm"], world_size=world_size,
                        options=options) for _ in range(2)]
    assert _json_without_wall_time(plans[0]) == _json_without_wall_time(plans[1])
    assert plans[0].solver["status"] in ("OPTIMAL", "FEASIBLE")
    if blocks > large_from:
        assert 0 <= plans[0].solver["relative_gap"] < 1
        assert len(plans[0].solver["windows"]) <= 1  # at most one CP-SAT model


def test_plan_fields_the_executor_reads():
    graph = synthetic_graph(4)
    plan = solve_plan(graph, budget_bytes=12 * GiB, hardware=PRESETS["h100-sxm"], world_size=2, micro_batches=2,
                      loss_chunk_tokens=1024)
    assert plan.window in (1, 2, 3, 4) and plan.workload.micro_batches == 2 and plan.loss_chunk_tokens == 1024
    assert plan.update_order[0] == 0 and sorted(plan.update_order) == list(range(6))
    for d in plan.decisions:
        assert d.chunks % 2 == 0 and len(d.owners) == d.chunks and set(d.owners) == {0, 1}
        assert d.activation in (("resident",) if d.kind != "block" else ("recompute", "keep", "offload",
                                                                          "recompute_offload"))
    assert plan.peak_device_bytes <= 12 * GiB
    assert plan.predicted_step_time_s == pytest.approx(plan.solver["objective_s"])
    assert plan.predicted_step_time_s == pytest.approx(max(e.end_s for e in plan.timeline))
    assert {e.rank for e in plan.timeline} == {0, 1}
    loaded = slidedp.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert loaded == plan


def test_offloaded_activations_stay_within_host_memory():
    """A host-memory limit on offloaded activations binds the solver like brute force, also for the
    smallest budget (offloading is what lowers the device peak)."""
    c = CASES["activations, windows, orders"]
    graph = c["graph"]()

    def costs_with(limit):
        return ProblemCosts(Problem(graph, PRESETS[c["hardware"]], 1, micro_batches=2, host_offload_bytes=limit),
                            SolverOptions(**c["options"]))

    free = costs_with(None)
    one_block = max(2 * b.saved_bytes for b in free.blocks.values())
    for limit in (0, one_block):
        costs = costs_with(limit)
        allowed = [d for d in all_decisions(costs) if costs.host_offload_bytes(d) <= limit]
        smallest = min(peak(costs, d) for d in allowed)
        with pytest.raises(slidedp.InfeasibleBudgetError) as info:
            solve(costs, smallest - 1)
        assert info.value.min_budget_bytes == smallest
        for budget in (smallest, binding_budget(costs)):
            best, _ = brute_force(costs, budget)
            sol = solve(costs, budget)
            assert sol.makespan == best and costs.host_offload_bytes(sol.decisions) <= limit
    # the limit matters: at some budget the unlimited plan offloads and is faster than any without
    peaks = sorted({peak(free, d) for d in all_decisions(free)})
    assert any(free.host_offload_bytes(sol.decisions) > 0 and sol.makespan < solve(costs_with(0), b).makespan
               for b in peaks[::7] for sol in [solve(free, b)])


def test_a_budget_only_offloaded_block_inputs_fit_agrees_with_brute_force():
    """Block inputs (the boundary stash) dominate: below the smallest peak without recompute_offload,
    CP-SAT alone, the whole planner and brute force agree on the fastest decisions, which offload
    some blocks' inputs; a host limit on offloaded bytes counts them."""
    graph = synthetic_graph(5, saved_bytes=1024 * MiB, boundary_bytes=512 * MiB)

    def costs_with(activations, limit=None):
        return ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, micro_batches=2, host_offload_bytes=limit),
                            SolverOptions(activations=activations, chunk_multiples=(1,), windows=(1,),
                                          update_orders=("forward",)))

    without = costs_with(("recompute", "keep"))
    costs = costs_with(("recompute", "keep", "recompute_offload"))
    floor_without = min(peak(without, d) for d in all_decisions(without))
    budget = floor_without - 1
    best, best_d = brute_force(costs, budget)
    assert any(c.activation == "recompute_offload" for c in best_d.layers)
    results = [cpsat.solve_window(costs, w, budget, None, 30.0) for w in costs.windows()]
    assert all(r.status == "OPTIMAL" for r in results) and min(r.objective for r in results) == best
    sol = solve(costs, budget)
    assert sol.makespan == best and sol.status == "OPTIMAL" and peak(costs, sol.decisions) <= budget
    with pytest.raises(slidedp.InfeasibleBudgetError):
        solve(without, budget)
    # each offloaded input takes m * boundary bytes of host memory: a limit of one block's allows one
    one = costs_with(costs.options.activations, limit=2 * costs.boundary_bytes)
    found = brute_force(one, budget)
    if found is None:
        with pytest.raises(slidedp.InfeasibleBudgetError):
            solve(one, budget)
    else:
        sol = solve(one, budget)
        assert sol.makespan == found[0] and one.host_offload_bytes(sol.decisions) <= 2 * costs.boundary_bytes


def test_a_decision_is_credited_to_cp_sat_only_when_cp_sat_beat_every_heuristic():
    """The plan names the search whose decisions it holds; on a tie the heuristic is credited."""
    import slidedp
    from slidedp.scheduler.search.found import Found, fastest
    from tests.models import make_model

    sim = type("Sim", (), {"makespan": 10, "peak_bytes": 5})()
    heuristic, solver = Found("baseline:greedy", None, sim), Found("cp-sat", None, sim)
    assert fastest([heuristic, solver]) is heuristic
    for budget in ("1GiB", "2MiB"):
        plan = slidedp.plan(make_model("llama"), budget, batch_size=2, seq_len=16, precision="fp32", device="cpu")
        sv = plan.solver
        core = sv["chosen_by"].split(" + ")[0]
        credited = sv["searches"]["window, chunks, activations, routes, update owners"]
        solved = [w["objective_s"] for w in sv["windows"] if w["objective_s"] is not None]
        if core == "cp-sat":
            assert credited == "CP-SAT" and min(solved) < min(sv["candidates"].values())
        else:
            assert credited.startswith(core) and "CP-SAT found nothing better" in credited
            assert not solved or min(sv["candidates"].values()) <= min(solved)
        assert "decided by: window, chunks" in plan.summary()


def test_a_host_budget_that_forces_device_state_agrees_with_brute_force():
    """With a host budget below what the plan takes with the state of no layer (nor of one layer) on the
    device, the plan keeps the state of some layers there (0 host bytes each, one rank): its step is the
    fastest that brute force finds over every placement of the state, every delivery copy and every
    other decision within both budgets (what the host budget leaves beside the placement's fixed part
    bounding the offloaded activations and kept copies)."""
    from slidedp.scheduler.solve import _placement_problem

    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0))
    hw = PRESETS["h200-sxm"]
    options = SolverOptions(activations=("recompute", "keep", "offload"), chunk_multiples=(1,), windows=(1, 2),
                            update_orders=("forward",), device_state_prologue=False)
    base = Problem(graph, hw, 1, micro_batches=2)
    tight = ProblemCosts(_placement_problem(base, options, 0), options)  # copies a decision, as they are below
    assert tight.problem.device_state_optional == {b.id for b in graph.blocks} | {graph.epilogue.id}
    candidates = [b.id for b in graph.blocks] + [graph.epilogue.id]
    fixed = [tight.host_fixed.bytes(candidates[:k]) for k in range(len(candidates) + 1)]
    assert all(a > b for a, b in zip(fixed, fixed[1:]))  # each layer moved to the device frees host RAM
    budget = 40 * GiB
    host_budget = (fixed[1] + fixed[2]) // 2  # two layers or more on the device; the rest bounds the offloads
    costs = ProblemCosts(_placement_problem(base, options, host_budget), options)
    ticks, best = brute_force(costs, budget)
    assert len(best.device_state) >= 2
    plan = solve_plan(graph, budget_bytes=budget, hardware=hw, micro_batches=2, options=options,
                      host_budget_bytes=host_budget)
    assert round(plan.predicted_step_time_s / plan.solver["tick_s"]) == ticks
    assert len(plan.device_state) >= 2 and plan.peak_host_bytes <= host_budget
    free_plan = solve_plan(graph, budget_bytes=budget, hardware=hw, micro_batches=2,
                           options=replace(options, device_state_blocks=0))
    assert free_plan.peak_host_bytes > host_budget >= plan.peak_host_bytes
    with pytest.raises(slidedp.InfeasibleBudgetError, match="host budget"):
        solve_plan(graph, budget_bytes=budget, hardware=hw, micro_batches=2, host_budget_bytes=host_budget,
                   options=replace(options, device_state_blocks=0))


def test_the_placement_of_the_optimizer_state_is_credited_to_the_search_that_made_it(monkeypatch):
    """The plan credits the placement to CP-SAT where CP-SAT made it (heuristics that cannot place any
    state on the device: CP-SAT's model puts it there), and to the heuristic whose decisions won
    otherwise (CP-SAT found nothing better); its alternative is one layer more or fewer there, simulated."""
    from slidedp.scheduler.search import device_placement, local_search

    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0))
    kw = dict(budget_bytes=40 * GiB, hardware=PRESETS["h200-sxm"], micro_batches=2,
              options=SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2)))
    plan = solve_plan(graph, **kw)
    core = plan.solver["chosen_by"].split(" + ")[0]
    credit = plan.solver["searches"]["optimizer state on the device"]
    assert plan.device_state and (credit == "CP-SAT" if core == "cp-sat" else
                                  credit.startswith(core) and "CP-SAT found nothing better" in credit)
    alternative = next(a for a in plan.alternatives if a.decision == "optimizer state on the device")
    assert alternative.chosen_step_s == pytest.approx(plan.predicted_step_time_s)
    assert alternative.runner_up_step_s is None or alternative.runner_up_step_s >= plan.predicted_step_time_s
    monkeypatch.setattr(device_placement, "search", lambda *args: None)
    monkeypatch.setattr(local_search, "improve", lambda costs, start, *args, **kw: start)
    by_cpsat = solve_plan(graph, **kw)
    assert by_cpsat.solver["chosen_by"].split(" + ")[0] == "cp-sat" and by_cpsat.device_state
    assert by_cpsat.solver["searches"]["optimizer state on the device"] == "CP-SAT"
    assert "decided by: optimizer state on the device: CP-SAT" in by_cpsat.summary()
    assert by_cpsat.predicted_step_time_s == pytest.approx(plan.predicted_step_time_s)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_vocabulary_choice_is_credited_to_the_search_that_made_it(monkeypatch, tied):
    """Below the resident tables' floor a table must stream: with no heuristic candidates the CP-SAT
    model's Boolean makes that choice, and the plan credits it to CP-SAT (not to a sweep)."""
    from slidedp.scheduler import solve as solve_module

    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0), vocab=64000, hidden=2048, tied=tied)
    options = SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                            update_orders=("forward",), device_state_blocks=0, streamed_layers=0,
                            vocab_chunk_numel=16 * 2**20)
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        solve_plan(graph, budget_bytes=1, hardware=PRESETS["h100-sxm"], options=replace(options, vocab_streamed=()))
    budget = info.value.min_budget_bytes - 1  # the resident tables do not fit
    monkeypatch.setattr(solve_module, "_heuristics", lambda *args: [])
    plan = solve_plan(graph, budget_bytes=budget, hardware=PRESETS["h100-sxm"], options=options)
    assert plan.solver["chosen_by"].split(" + ")[0] == "cp-sat"
    streamed = [k for k in plan.solver["searches"] if k.startswith("streamed vocabulary")]
    assert len(streamed) == 1 and "none" not in streamed[0]
    assert plan.solver["searches"][streamed[0]].startswith("CP-SAT")
    assert {d.activation for d in plan.decisions if d.kind != "block"} >= {"streamed"}
    assert plan.peak_device_bytes <= budget


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocabulary_streaming_agrees_with_brute_force(tied):
    """Which tables stream, a decision of the CP-SAT model (Problem.vocab_choices), agrees with brute
    force over every decision and every set of streamed tables (each set a problem of its own, and all
    of them as one), at budgets where only streaming fits, where streaming buys kept activations, and
    where everything fits; its floor is the smallest. A tied table streams for both layers or neither.
    The plan credits the choice to the search whose decisions it holds."""
    from slidedp.scheduler.oracles.brute_force import brute_force_vocab

    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0), vocab=64000, hidden=2048, tied=tied)
    assert len(graph.vocab_sets()) == (2 if tied else 4)
    options = SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                            update_orders=("forward",), device_state_blocks=0, streamed_layers=0,
                            vocab_chunk_numel=16 * 2**20)
    problem = Problem(graph, PRESETS["h100-sxm"], 1, vocab_chunk_numel=options.vocab_chunk_numel)
    floors = {}
    for choice in graph.vocab_sets():
        costs = ProblemCosts(Problem(graph, PRESETS["h100-sxm"], 1, vocab_streamed=choice,
                                     vocab_chunk_numel=options.vocab_chunk_numel), options)
        floors[choice] = min(peak(costs, d) for d in all_decisions(costs))
    resident, lowest = floors[frozenset()], min(floors.values())
    assert lowest < resident - (1 if tied else 2) * 64000 * 2048  # streaming frees at least the tables' weights
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        solve_plan(graph, budget_bytes=lowest - 1, hardware=PRESETS["h100-sxm"], options=options)
    assert info.value.min_budget_bytes == lowest
    for budget in (lowest, (lowest + resident) // 2, resident, resident + 4 * GiB):
        ticks, choice, _ = brute_force_vocab(problem, options, budget)
        if budget == lowest:  # the sets as one problem: the same optimum, by brute force and CP-SAT alone
            union = ProblemCosts(replace(problem, vocab_choices=tuple(graph.vocab_sets())), options)
            assert brute_force(union, budget)[0] == ticks
            results = [cpsat.solve_window(union, w, budget, None, 30.0) for w in union.windows()]
            assert min(r.objective for r in results if r.objective is not None) == ticks
        plan = solve_plan(graph, budget_bytes=budget, hardware=PRESETS["h100-sxm"], options=options)
        tick = plan.solver["tick_s"]
        assert round(plan.predicted_step_time_s / tick) == ticks, budget
        streamed = {d.layer_id for d in plan.decisions if d.activation == "streamed"}
        assert plan.peak_device_bytes <= budget
        if budget < resident:
            assert streamed
        label = "none" if not streamed else " + ".join(
            n for n, i in (("prologue", 0), ("epilogue", len(graph.layers) - 1)) if i in streamed)
        credit = plan.solver["searches"][f"streamed vocabulary ({label}{' (tied table)' if tied and streamed else ''})"]
        core = plan.solver["chosen_by"].split(" + ")[0]
        assert credit.startswith("CP-SAT") if core == "cp-sat" else (
            credit.startswith(core) and "CP-SAT found nothing better" in credit), credit
        assert "sweep" not in credit


def test_a_streamed_tied_table_is_priced_for_both_uses():
    """Streamed, the tied table (stored by the prologue) is loaded for the epilogue's forward and again
    for its backward and the head's gradient goes down: the epilogue's copies move the table's bytes;
    with the CPU reduction the prologue's update sums both uses' copies (one rank: adds the embedding's
    part to the head's on the host); the device holds neither the
    table nor its gradient; the prologue's delivery copy is kept (no decision), and no gradient
    streams into the update."""
    vocab, hidden, elem = 64000, 2048, 2
    graph = synthetic_graph(3, vocab=vocab, hidden=hidden, tied=True)
    pro, epi, both = 0, len(graph.layers) - 1, frozenset({0, len(graph.layers) - 1})
    base = Problem(graph, PRESETS["h100-sxm"], 2, copies_on_load=True)
    with pytest.raises(ValueError, match="tied table: both"):
        replace(base, vocab_streamed=frozenset({epi}))
    with pytest.raises(ValueError, match="sum of two uses"):
        replace(base, vocab_streamed=both, grads_streamable=True)
    assert not replace(base, grads_streamable=True).with_vocab_streamed(both).grads_streamable
    assert replace(base, grads_streamable=True).with_vocab_streamed(frozenset()).grads_streamable
    options = SolverOptions(chunk_multiples=(1,), host_copies=("kept", "on_load"))
    resident, streamed = ProblemCosts(base, options), ProblemCosts(base.with_vocab_streamed(both), options)
    res = {i: resident.option_of(i, LayerChoice(2, "resident")) for i in (pro, epi)}  # replicated, cpu, kept
    st = {i: streamed.option_of(i, LayerChoice(2, "streamed")) for i in (pro, epi)}
    table = vocab * hidden
    assert res[epi].piece_bytes == hidden * elem // 2 and st[epi].piece_bytes == (table + hidden) * elem // 2
    assert st[epi].fwd_piece > 10 * res[epi].fwd_piece and st[epi].grad_piece > 10 * res[epi].grad_piece
    assert st[pro].update_piece > res[pro].update_piece and st[pro].fwd_piece == res[pro].fwd_piece
    assert streamed.head_reload and streamed.epilogue > resident.epilogue
    assert resident.resident_params_bytes - streamed.resident_params_bytes == table * elem
    assert resident.resident_grads_bytes - streamed.resident_grads_bytes == table * 4
    assert pro in resident.copyable and pro not in streamed.copyable and epi in streamed.copyable
    # one rank, or the GPU reduction: the embedding's part is added to the head's on the host, once
    one = Problem(graph, PRESETS["h100-sxm"], 1)
    alone = {v: ProblemCosts(one.with_vocab_streamed(v), options).option_of(pro, LayerChoice(1, a))
             for v, a in ((frozenset(), "resident"), (both, "streamed"))}
    added = PRESETS["h100-sxm"].host_dram_bytes_per_s
    assert alone[both].update_piece - alone[frozenset()].update_piece == \
        pytest.approx(streamed.scale.ticks(table * (elem + 8) / added), abs=1)


def test_streamed_gradients_are_a_decision_of_the_cp_sat_model():
    """Where the gradients may stream into the update, CP-SAT alone (no hint) chooses them streamed where
    that is the fastest step (brute force over both), its objective is their simulated step, the plan
    credits CP-SAT for that decision, and the closed form (the hints' timing) gives the simulator's step
    for every such decision."""
    costs = make_costs("gradients streamed or kept, 2 ranks, either reduction")
    budget = binding_budget(costs)
    best, best_d = brute_force(costs, budget)
    kept = min(simulate(costs, d).makespan for d in all_decisions(costs)
               if not d.grads_streamed and costs.fits(d, peak(costs, d), budget))
    assert best_d.grads_streamed and best < kept
    results = [cpsat.solve_window(costs, w, budget, None, 30.0) for w in costs.windows()]
    found = min((r for r in results if r.objective is not None), key=lambda r: r.objective)
    assert found.objective == best and found.decisions.grads_streamed
    assert found.decisions.early_order == tuple(i for i in landing_order(costs.n_layers))
    sol = solve(costs, budget)
    assert sol.decisions.grads_streamed and sol.chosen_by == "cp-sat"
    assert _searches(sol, costs)["gradients streamed into the update"] == "CP-SAT"
    (why,) = [a for a in alternatives(costs, sol.decisions, simulate(costs, sol.decisions, all_ranks=False), budget)
              if a.decision == "gradients"]
    assert why.chosen == "streamed into the update" and why.runner_up == "kept to the step boundary"
    assert why.runner_up_step_s >= why.chosen_step_s == pytest.approx(best * costs.scale.tick_s)
    for d in itertools.islice((d for d in all_decisions(costs) if d.grads_streamed), 0, None, 17):
        assert closed_form.evaluate(costs, d).makespan == simulate(costs, d, all_ranks=False).makespan


def test_kept_gradients_count_against_the_host_budget_in_the_model():
    """With a host budget that the kept gradients overflow, the model streams them (the least host RAM of
    the leanest layout counts none), and without the choice the same budget plans nothing."""
    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0))
    options = SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                            update_orders=("forward",))
    problem = Problem(graph, PRESETS["h200-sxm"], 1, micro_batches=2, grads_streamable=True)
    costs = ProblemCosts(problem, options)
    fixed = costs.host_fixed.bytes(())
    host_budget = fixed + costs.streamable_grad_bytes(Decisions(1, "forward", ())) // 2
    tight = ProblemCosts(replace(problem, host_budget_bytes=host_budget), options)
    sol = solve(tight, 40 * GiB)
    assert sol.decisions.grads_streamed
    assert tight.fits(sol.decisions, simulate(tight, sol.decisions).peak_bytes, 40 * GiB)
    assert not tight.fits(replace(sol.decisions, grads_streamed=False, early_order=()),
                          simulate(tight, sol.decisions).peak_bytes, 40 * GiB)
    with pytest.raises(slidedp.InfeasibleBudgetError, match="host budget"):
        solve(ProblemCosts(replace(problem, host_budget_bytes=host_budget, grads_streamable=False), options),
              40 * GiB)


def test_random_small_problems_with_streamable_gradients_agree_with_brute_force():
    """Seeded random 2-block problems (block sizes, one or two ranks, H100 or H200, the optimizer state
    placed or not, the budget halfway up the peaks): CP-SAT alone proves the brute-force optimum over
    every decision, the gradients streamed or kept included, and picks them streamed in some of them."""
    import random

    rng = random.Random(7)
    streamed = 0
    for _ in range(40):
        graph = synthetic_graph(2, block_scale=tuple(rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(2)))
        W = rng.choice([1, 2])
        placed = frozenset(layer.id for layer in graph.layers) if rng.random() < 0.3 else frozenset()
        options = SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                                update_orders=("forward",), deliveries=("replicated",),
                                reductions=("cpu", "gpu") if W > 1 else ("cpu",))
        problem = Problem(graph, PRESETS[rng.choice(["h200-sxm", "h100-sxm"])], W, micro_batches=2,
                          grads_streamable=True, device_state_optional=placed)
        costs = ProblemCosts(replace(problem, vocab_chunk_numel=options.vocab_chunk_numel), options)
        peaks = sorted(peak(costs, d) for d in all_decisions(costs))
        budget = peaks[len(peaks) // 2]
        best, best_d = brute_force(costs, budget)
        results = [cpsat.solve_window(costs, w, budget, None, 20.0) for w in costs.windows()]
        assert all(r.status in ("OPTIMAL", "INFEASIBLE") for r in results)
        assert min(r.objective for r in results if r.objective is not None) == best
        streamed += best_d.grads_streamed
    assert 0 < streamed < 40


def test_a_decision_with_early_updates_fits_only_with_its_spare_state():
    """Early updates write a spare master and moments: a decision with them fits the host only where its
    spare state fits beside what else it keeps (ProblemCosts.fits), so no later pass (a descent keeping
    more delivery copies, say) can leave a plan above its host budget. Planned over a sweep of host
    budgets with early updates and streamed updates allowed, every plan keeps within its budget."""
    graph = synthetic_graph(3, block_scale=(1.0, 0.5, 2.0))
    hw = PRESETS["h200-sxm"]
    options = SolverOptions(activations=("recompute", "keep"), chunk_multiples=(1,), windows=(1, 2),
                            update_orders=("forward",))
    base = Problem(graph, hw, 1, micro_batches=1, early_host_bytes=1 << 62, copies_on_load=True)
    costs = ProblemCosts(base, options)
    d = baselines.uniform(costs, window=2, activation="recompute")
    early = replace(d, early_order=tuple(landing_order(costs.n_layers)))
    spare = costs.spare_bytes(early)
    assert spare > 0 and costs.spare_bytes(d) == 0
    fixed = costs.host_fixed.bytes(())
    tight = ProblemCosts(replace(base, host_budget_bytes=fixed + costs.host_left_bytes(d) + spare - 1), options)
    assert tight.fits(d, 0, 1) and not tight.fits(early, 0, 1)
    for extra in (0.1, 0.3, 0.5, 0.8):
        host_budget = int(fixed + extra * spare)
        plan = solve_plan(graph, budget_bytes=40 * GiB, hardware=hw, options=options, early_host_bytes=1 << 62,
                          streamed_updates=True, host_budget_bytes=host_budget)
        assert plan.peak_host_bytes <= host_budget


def test_a_larger_budget_leaves_room_for_streamed_updates():
    """Streamed updates need their slots on the device: at 6 GiB the searches filled the budget with kept
    activations and optimizer state and the plan streamed nothing (2.151 s) where at 5 GiB it streamed
    (1.794 s). Descents within the budget less the slots are starts too: the larger budget plans no
    slower (Qwen3-4B shape, 16,384 tokens, clipping at 1.0, H200 preset)."""
    from benchmarks.common.model import empty_model

    model = empty_model("4b", dtype=torch.bfloat16, device="cpu")
    steps = [slidedp.plan(model, budget, batch_size=1, seq_len=4096, micro_batches=4, hardware="h200-sxm",
                          max_grad_norm=1.0, host_memory="110GiB").predicted_step_time_s for budget in ("5GiB", "6GiB")]
    assert steps[1] <= steps[0]
