"""Planning: the smallest feasible budget, the baselines, CP-SAT per window, the best of all of
them, and the Plan (decode -> simulate -> emit).

The plan returned is never slower than a baseline that fits (they are all simulated with the same
oracle and the fastest wins), and CP-SAT's objective for the decisions it returns equals their
simulated step time (asserted in cpsat.solve_window).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version as package_version

from slidedp.budget import format_bytes
from slidedp.costmodel import memory as mem
from slidedp.costmodel import ops
from slidedp.costmodel.hardware import Hardware
from slidedp.errors import InfeasibleBudgetError
from slidedp.ir.graph import LayerGraph
from slidedp.scheduler.search import baselines, cpsat, device_placement, early_order, local_search, streamed_prefix
from slidedp.scheduler.search.found import Found, fastest
from slidedp.scheduler.search.floor import lanes_floor
from slidedp.scheduler.problem.costs import ProblemCosts, host_fixed_bytes
from slidedp.scheduler.decisions import GPU, KEEP, OFFLOAD, RECOMPUTE_OFFLOAD, SHARDED, Decisions, Problem, SolverOptions
from slidedp.scheduler.explain import alternatives, device_state_label, group_predictions
from slidedp.scheduler.plan import (
    SCHEMA_VERSION, Alternative, Explanation, LayerDecision, MemoryPoint, Plan, Schedule, TimelineEvent, Workload,
)
from slidedp.scheduler.problem.lanes import COLLECTIVE, COMPUTE, CPU_UPDATE, D2H, H2D, window_loads
from slidedp.scheduler.oracles import closed_form
from slidedp.scheduler.oracles.timeline import simulate


def minimum_budget(costs: ProblemCosts, host: bool = True) -> tuple[int, Decisions, dict[int, int], int] | None:
    """The smallest budget with which planning succeeds: the least peak over every decision within
    the host budget (`host` False: whatever the host takes; a CP-SAT solve at the smallest window),
    decisions reaching it, the least budget of each window (a lower bound), and the proven lower
    bound of the least peak (the peak itself where CP-SAT proves it minimal); None where no decisions
    fit the host budget. The window only adds its slots (footprint.py), so each window's minimum is
    the smallest one plus (window - smallest) slots."""
    windows = costs.windows()
    found = cpsat.minimum_peak(costs, windows[0], host=host)
    if found is None:
        return None
    peak, bound, decisions = found
    slot = costs.weight_slots_bytes(1)
    return peak, decisions, {w: bound + (w - windows[0]) * slot for w in windows}, bound


@dataclass(frozen=True)
class Solution:
    """What planning found, before it becomes a Plan (ticks: costs.scale)."""

    decisions: Decisions
    makespan: int  # simulated step time of `decisions`
    bound: int  # no decisions have a shorter step
    status: str  # OPTIMAL (bound reached) | FEASIBLE
    chosen_by: str  # "cp-sat", "baseline:...", "local-search-..." (the fastest, the solver on ties)
    candidates: tuple[tuple[str, int], ...]  # every heuristic's makespan
    windows: tuple[cpsat.WindowResult, ...]  # one CP-SAT model per window solved
    lower_bound: int
    min_budget_bytes: int
    deterministic_time_limit: float
    streamed_tried: dict = field(default_factory=dict)  # streamed layers k -> step [s] (streamed.py)
    gap_explained: str = ""  # where the bound comes from, in words (`_gap_words`)


def _device_too_small(costs: ProblemCosts, budget_bytes: int, min_budget: int,
                      min_decisions: Decisions) -> InfeasibleBudgetError:
    """The error of a device budget below the smallest schedule's peak (with the host bytes of that
    schedule's placement: a plan needs them too)."""
    sim = simulate(costs, min_decisions, all_ranks=False)
    min_host = costs.variant(min_decisions).host_fixed.bytes(min_decisions.device_state)
    host_budget = costs.problem.host_budget_bytes
    return InfeasibleBudgetError(
        f"the device budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the "
        f"{format_bytes(min_budget)} ({min_budget} bytes) that the smallest schedule needs "
        f"({_largest_terms(sim.footprint.breakdown)}); give at least {min_budget} bytes, or plan fewer "
        f"micro-batches or a smaller batch (host memory: that schedule needs at least "
        f"{format_bytes(min_host)}, {min_host} bytes)",
        min_budget_bytes=min_budget, budget_bytes=budget_bytes, min_host_bytes=min_host, host_budget_bytes=host_budget)


def _host_too_small(costs: ProblemCosts, budget_bytes: int) -> InfeasibleBudgetError:
    """The error of budgets that no decisions fit together: of the device's where it is below the least
    peak of any decisions whatever the host takes, else of the host's, naming the least host RAM of any
    decisions within the device budget (the leanest host layout: optimizer state on the device where
    it fits, delivery copies made on load, no offloaded activations where the device budget allows)."""
    min_budget, min_decisions, _, min_bound = minimum_budget(costs, host=False)
    if budget_bytes < min_bound:
        return _device_too_small(costs, budget_bytes, min_budget, min_decisions)
    host_budget = costs.problem.host_budget_bytes
    found = cpsat.minimum_host(costs, costs.windows()[0], budget_bytes)
    if found is None:  # a budget within the least-peak model's gap that nothing fits
        return _device_too_small(costs, budget_bytes, min_budget, min_decisions)
    need, leanest = found
    parts = costs.variant(leanest).host_fixed.memory(leanest.device_state)
    return InfeasibleBudgetError(
        f"the host budget {format_bytes(host_budget)} ({host_budget} bytes) is below the {format_bytes(need)} "
        f"({need} bytes) that the leanest plan needs (host state {format_bytes(parts['state'])} with the "
        f"optimizer state of {device_state_label(costs.problem.graph, leanest.device_state)} on the device, "
        f"pinned buffers {format_bytes(parts['pinned_buffers'])}, the device state's staging "
        f"{format_bytes(parts['load_staging'])}); give host_memory at least {need} bytes, or a larger device "
        f"budget to keep more optimizer state on the device (the device budget {format_bytes(budget_bytes)} "
        f"needs at least {format_bytes(min_budget)}, {min_budget} bytes)",
        min_budget_bytes=min_budget, budget_bytes=budget_bytes, min_host_bytes=need, host_budget_bytes=host_budget)


def _heuristics(costs: ProblemCosts, budget_bytes: int, min_budget: int, min_decisions: Decisions) -> list[Found]:
    """The heuristics' candidates: the baselines that fit, the least-memory decisions (`min_decisions`,
    of peak `min_budget`; they fit unless the budget is below the least peak found and above its proven
    bound), the placement seed of the optimizer state (search/device_placement.py), and a local search
    from each of the two best distinct ones; where the placement is a decision, then one from the
    least-memory decisions with the best placement so far (offloads that a descent from the others
    rarely reaches). Where the gradients may stream into the update, a candidate that keeps them but
    does not fit the host is taken with them streamed (Decisions.with_streamed_gradients), if that fits."""
    found = [baselines.strategy(name)(costs, budget_bytes) for name in baselines.BASELINES]
    found.append(device_placement.search(costs, budget_bytes, min_decisions, min_budget))
    candidates = [f for f in (_fitting(costs, f, budget_bytes) for f in found if f) if f]
    if min_budget <= budget_bytes:
        candidates.append(Found("least-memory", min_decisions, simulate(costs, min_decisions, all_ranks=False)))
    starts: list[Decisions] = []
    for f in sorted(candidates, key=lambda f: f.makespan):
        if f.decisions not in starts:
            starts.append(f.decisions)
    for k, d in enumerate(starts[:2]):
        candidates.append(local_search.search(costs, budget_bytes, d, name=f"local-search-{k + 1}"))
    incumbent = fastest(candidates)
    placement = incumbent.decisions.device_state if incumbent is not None else None
    if costs.problem.device_state_optional and placement is not None and placement != min_decisions.device_state:
        least = cpsat.minimum_peak(costs, costs.windows()[0], on_device=placement)
        if least is not None and least[0] <= budget_bytes:
            candidates.append(local_search.search(costs, budget_bytes, least[2], name="local-search-3"))
    return candidates


def _fitting(costs: ProblemCosts, f: Found, budget_bytes: int) -> Found | None:
    """`f` if it fits; else, where only the gradients it keeps in host RAM are too many, `f` with them
    streamed into the update (if that is allowed and fits); else None."""
    if costs.fits(f.decisions, f.simulation.peak_bytes, budget_bytes):
        return f
    if f.decisions.grads_streamed or not costs.may_stream_gradients(f.decisions):
        return None
    d = f.decisions.with_streamed_gradients(costs.n_layers)
    sim = simulate(costs, d, all_ranks=False)
    return Found(f"{f.by} (gradients streamed)", d, sim) if costs.fits(d, sim.peak_bytes, budget_bytes) else None


# Rounds of `_after`'s descent, each followed by the streamed prefix chosen again for what it changed.
POLISH_ROUNDS = 3
# The distinct candidates, best first, that `_after` starts from: its passes can reorder them.
AFTER_STARTS = 3


def _after(costs: ProblemCosts, budget_bytes: int, best: Found):
    """The passes after the search from `best`: (decisions, simulation, chosen_by, whether early updates
    and whether streamed updates were taken, the streamed updates tried).

    Early updates (if allowed, where the gradients do not stream) take the chosen decisions' CPU work
    into the backward; the search does not model them, so its bound is not one for them: the
    analytical one is. Streamed updates (if allowed): the device takes
    the first host layers' updates off the CPU. The searches judge window, chunks, activations, routes
    and update order at the step boundary, and a time-limited CP-SAT may stop short: a descent from the
    final decisions by whole-group moves (the ones the plan's alternatives are compared with), crediting
    what it changes; where it changes something, the streamed prefix is chosen again for the new
    decisions, and the descent runs again while either gains (POLISH_ROUNDS at most)."""
    chosen_by, decisions, best_sim = best.by, best.decisions, best.simulation
    assert best_sim.peak_bytes <= budget_bytes, (chosen_by, best_sim.peak_bytes, budget_bytes)
    early = early_order.search(costs, budget_bytes, decisions)
    took_early = early is not None and early.makespan < best_sim.makespan
    if took_early:
        decisions, best_sim = early.decisions, early.simulation
        chosen_by += f" + {early.by}"
    streamed = streamed_prefix.search(costs, budget_bytes, decisions)
    streamed_tried = streamed.tried if streamed is not None else {}
    fixed = costs.options.streamed_layers is not None
    # (none streamed, e.g. SolverOptions.streamed_layers=0: not taken, and not credited)
    took_streamed = (streamed is not None and bool(streamed.decisions.streamed)
                     and (fixed or streamed.makespan < best_sim.makespan))
    if took_streamed:
        decisions, best_sim = streamed.decisions, streamed.simulation
        chosen_by += " + streamed updates"
    for _ in range(POLISH_ROUNDS):
        polished = local_search.search(costs, budget_bytes, decisions, name="local search")
        if polished.makespan >= best_sim.makespan:
            break
        changed = local_search.changed(decisions, polished.decisions)
        decisions, best_sim = polished.decisions, polished.simulation
        chosen_by += f" + local search ({', '.join(changed)})"
        # the descent changed what the streamed prefix was chosen for: choose it again
        again = None if fixed or streamed is None else streamed_prefix.search(costs, budget_bytes, decisions)
        if again is None or again.makespan >= best_sim.makespan or not again.decisions.streamed:
            break
        decisions, best_sim = again.decisions, again.simulation
        streamed_tried, took_streamed = again.tried, True
        chosen_by += " + streamed updates"
    return decisions, best_sim, chosen_by, took_early, took_streamed, streamed_tried


def _room_for_streamed(costs: ProblemCosts, budget_bytes: int, found: list[Found], min_decisions: Decisions,
                       min_budget: int) -> list[Found]:
    """Streamed updates hold their slots on the device (costs.streamed_update_bytes), which the searches
    may have filled with kept activations or optimizer state, a room the streamed prefix then cannot
    make: descents within the budget less the slots, from the fastest decisions that fit it and from the
    least-memory ones, are more starts for `_after` (without them, Qwen3-4B at 16,384 tokens planned
    2.151 s at 6 GiB against 1.794 s at 5 GiB, and, where the other starts streamed only a few layers,
    1.883 s at 6 GiB against 1.855 s at 5 GiB); none where streamed updates are not allowed or no
    decisions leave the room."""
    room = budget_bytes - costs.streamed_update_bytes
    if not costs.problem.streamed_updates or costs.options.streamed_layers == 0 or room < min_budget:
        return []
    fitting = [f for f in found if costs.fits(f.decisions, f.simulation.peak_bytes, room)]
    starts = [min(fitting, key=lambda f: f.makespan).decisions] if fitting else []
    starts += [min_decisions] if min_decisions not in starts else []
    return [local_search.search(costs, room, d, name="local-search-room") for d in starts]


def solve(costs: ProblemCosts, budget_bytes: int) -> Solution:
    """Plan one problem: the smallest budget, the heuristics, CP-SAT per window, the best of all.

    Raises InfeasibleBudgetError below the smallest budgets that any decisions fit; its
    `min_budget_bytes` is the least simulated peak over every decision (exact where CP-SAT proves
    it; else the least it found, and a budget between its proven bound and that is searched), its
    `min_host_bytes` where the host is what binds the least host RAM within the device budget.
    """
    floor = minimum_budget(costs)
    if floor is None or budget_bytes < floor[3]:
        if costs.problem.host_budget_bytes is None:
            raise _device_too_small(costs, budget_bytes, floor[0], floor[1])
        raise _host_too_small(costs, budget_bytes)
    min_budget, min_decisions, min_per_window, min_bound = floor

    # Heuristics (`_heuristics`); where the tables that stream are a decision, those of each choice
    # (ProblemCosts.variants) whose least peak fits the budget.
    if costs.variants:
        candidates = []
        for variant in costs.variants.values():
            least = minimum_budget(variant)
            if least is not None and least[3] <= budget_bytes:
                candidates += _heuristics(variant, budget_bytes, least[0], least[1])
    else:
        candidates = _heuristics(costs, budget_bytes, min_budget, min_decisions)
    incumbent = fastest(candidates)

    # CP-SAT, one model per window that can fit (large models: the incumbent's window only), each
    # started from the best candidate of its window and looking no slower than the fastest step found
    # so far; the windows of the fastest hints first, each given the time the earlier ones left.
    # Skipped when the incumbent meets the bound.
    lanes = lanes_floor(costs, budget_bytes)  # valid whichever updates the plan takes
    lower = max(cpsat.lower_bound(costs, early=costs.problem.grads_streamable), lanes)  # streamed gradients: no boundary
    feasible_windows = [w for w in costs.windows() if min_per_window[w] <= budget_bytes]
    small = costs.n_blocks <= costs.options.all_windows_up_to_blocks
    if incumbent is not None and incumbent.makespan <= lower:
        windows = []
    else:
        windows = feasible_windows if small or incumbent is None else [incumbent.decisions.window]
    time_left = 0.0
    if windows:
        time_left = costs.options.deterministic_time if small else costs.options.large_deterministic_time
    time_limit = time_left
    hints = {w: _window_hint(costs, budget_bytes, candidates, incumbent, min_decisions, w) for w in windows}
    results, solved = [], []
    for n, w in enumerate(sorted(windows, key=lambda w: (closed_form.evaluate(costs, hints[w]).makespan, w))):
        cutoff = fastest(candidates + solved)
        found, result = cpsat.search(costs, budget_bytes, hints[w], window=w,
                                     deterministic_time=time_left / (len(windows) - n),
                                     cutoff=None if cutoff is None else cutoff.makespan)
        time_left = max(0.0, time_left - result.deterministic_time)
        results.append(result)
        solved += [found] if found is not None else []
    results.sort(key=lambda r: r.window)
    best = fastest(candidates + solved)  # a tie credits the heuristic: CP-SAT found nothing better
    if best is None:  # a budget within the least-peak model's gap, and nothing found that fits it
        raise _device_too_small(costs, budget_bytes, min_budget, min_decisions)
    # The passes after the search (`_after`) from the AFTER_STARTS best distinct decisions; where the tables
    # that stream are a decision, also from the best of each other choice (the passes may favour another),
    # keeping the fastest.
    starts = [best]
    for f in sorted(candidates + solved, key=lambda f: f.makespan):
        if len(starts) < AFTER_STARTS and all(f.decisions != s.decisions for s in starts):
            starts.append(f)
    finals = [_after(costs, budget_bytes, f) for f in starts]
    # the searches may have filled the room that streamed updates' slots need, or left too little of it
    finals += [_after(costs, budget_bytes, f) for f in
               _room_for_streamed(costs, budget_bytes, candidates + solved, min_decisions, min_budget)
               if all(f.decisions != s.decisions for s in starts)]
    for choice in costs.variants:
        own = fastest([f for f in candidates + solved if costs.vocab_set(f.decisions) == choice])
        if own is not None and costs.vocab_set(own.decisions) != costs.vocab_set(best.decisions):
            finals.append(_after(costs, budget_bytes, own))
    decisions, best_sim, chosen_by, early, streamed, streamed_tried = min(
        finals, key=lambda f: (f[1].makespan, len(costs.vocab_set(f[0]))))  # ties: fewer tables streamed
    if early or streamed:
        results = [replace(r, best_bound=None) for r in results]
        lower = max(cpsat.lower_bound(costs, streamed=True) if streamed else cpsat.lower_bound(costs, early=True),
                    lanes)

    best_ticks = best_sim.makespan
    bounds = {w: lower for w in feasible_windows}
    for r in results:
        if r.status == "INFEASIBLE":  # (NOT_FASTER: bounded by the cutoff, never below the plan's step)
            bounds.pop(r.window, None)
        elif r.best_bound is not None:
            bounds[r.window] = max(lower, r.best_bound)
    bound = min(min(bounds.values(), default=best_ticks), best_ticks)
    words = _gap_words(costs, best_ticks, bound, lower, bounds, results, early, streamed, time_limit,
                       lanes_bind=lanes == lower)
    return Solution(decisions, best_ticks, bound, "OPTIMAL" if bound == best_ticks else "FEASIBLE", chosen_by,
                    tuple((f.by, f.makespan) for f in candidates), tuple(results), lower, min_budget,
                    time_limit, streamed_tried, words)


def _floor_words(costs: ProblemCosts, early: bool, streamed: bool, lanes_bind: bool) -> str:
    """What the analytical floor is: floor.lanes_floor where it binds, else cpsat.lower_bound for the
    passes the plan took."""
    if lanes_bind:
        return ("the busiest of the compute on the GPU, the two copy directions and a CPU lane once the work every plan "
                "must do (the activations of each block kept within the budget, offloaded or recomputed; the "
                "optimizer state of each layer on the device, or updated on the CPU or through the device) is shared "
                "among them at best")
    if streamed:
        return "the compute on the GPU alone (the device may take any update off the CPU)"
    if early or costs.problem.grads_streamable:
        return "the larger of the compute on the GPU and the updates on the CPU"
    return ("the larger of the compute on the GPU and the updates on the CPU followed by the backward of the head and "
            "the blocks")


def _gap_words(costs: ProblemCosts, step: int, bound: int, lower: int, bounds: dict[int, int],
               results: list[cpsat.WindowResult], early: bool, streamed: bool, time_limit: float,
               lanes_bind: bool) -> str:
    """The plan's gap in words: which window's bound is the lowest and why (CP-SAT stopped at its time
    limit, a window CP-SAT did not search, or the analytical floor, which is all there is where the plan
    takes early or streamed updates: CP-SAT's model holds neither)."""
    ms = lambda t: f"{t * costs.scale.tick_s * 1e3:.4g} ms"  # noqa: E731
    floor = f"the analytical floor, {_floor_words(costs, early, streamed, lanes_bind)}, {ms(lower)}"
    if bound >= step:
        if not results:
            return f"optimal: the step meets {floor}"
        return "optimal: CP-SAT proved every window the budget fits no faster than this step"
    searched = {r.window: r for r in results}
    w = min(w for w, b in bounds.items() if b == bound)  # the window whose bound is the plan's
    gap = f"no decisions step faster than {ms(bound)}, {(step - bound) / step:.1%} under the {ms(step)} of this plan: "
    if early or streamed:
        passes = " and ".join(p for p, took in (("early", early), ("streamed", streamed)) if took)
        return gap + (f"that bound is {floor}, since the CP-SAT model does not hold the {passes} updates the plan "
                      "takes; it says how loose that floor is more than how far the plan is from the best")
    if w not in searched:
        return gap + (f"window {w} was not searched by CP-SAT (a model of more than "
                      f"{costs.options.all_windows_up_to_blocks} blocks searches the window of the fastest heuristic "
                      f"only), so its bound is {floor}")
    r = searched[w]
    return gap + (f"CP-SAT stopped in window {w} ({r.status}) after {r.deterministic_time:.2f} of the "
                  f"{time_limit:g} deterministic seconds planning gives it"
                  + (f" (no lower than {floor})" if bound == lower else ""))


def _window_hint(costs: ProblemCosts, budget_bytes: int, candidates: list[Found], incumbent: Found | None,
                 min_decisions: Decisions, window: int) -> Decisions:
    """CP-SAT's start in `window`: the fastest candidate of that window; else the incumbent's decisions
    moved to it, where they fit; else the least-memory ones moved to it."""
    own = fastest([c for c in candidates if c.decisions.window == window])
    if own is not None:
        return own.decisions
    if incumbent is not None and baselines.peak_bytes(costs, replace(incumbent.decisions, window=window)) <= budget_bytes:
        return replace(incumbent.decisions, window=window)
    return replace(min_decisions, window=window)


def solve_plan(graph: LayerGraph, *, budget_bytes: int, hardware: Hardware, world_size: int = 1,
               precision: str = "bf16", micro_batches: int = 1, loss_chunk_tokens: int = 4096,
               options: SolverOptions | None = None, version: str = "0", explain: bool = True,
               compiled_blocks: bool = False, host_offload_bytes: int | None = None,
               early_host_bytes: int | None = None, streamed_updates: bool = False,
               host_budget_bytes: int | None = None, hosts: int = 1, link_bytes_per_s: float = 0.0,
               grads_streamable: bool = False) -> Plan:
    """Solve a schedule for `graph` under a per-GPU budget (see `solve`) and make its Plan;
    offloaded activations take at most `host_offload_bytes` of host memory per rank (None: no limit);
    early updates (one rank, no clipping) may take `early_host_bytes` for their spare state, with the
    offloaded activations of all ranks (None: no early updates); `streamed_updates` lets the devices
    update some host layers (each rank its own chunks); `grads_streamable` lets the host layers'
    gradients stream into their update (no clipping, a non-finite gradient stops training; several
    ranks: with the GPU reduction) and makes early updates write in place (no spare state).
    `host_budget_bytes` (None: unbounded) bounds everything the plan takes of host RAM, all ranks
    together (Explanation.host_memory: host state, spare state, offloaded activations, pinned
    buffers): a hard constraint like the device budget (InfeasibleBudgetError with min_host_bytes).
    Which layers keep their optimizer state on the device: a decision of the CP-SAT model, per layer
    (`_placement_problem`)."""
    t0 = time.perf_counter()
    problem = Problem(graph, hardware, world_size, micro_batches, loss_chunk_tokens, compiled_blocks,
                      host_offload_bytes, early_host_bytes=early_host_bytes, streamed_updates=streamed_updates,
                      hosts=hosts, link_bytes_per_s=link_bytes_per_s)
    options = options or SolverOptions()
    # several ranks stream their gradients only where every route the plan may take reduces on the GPUs
    # (with the CPU reduction the ranks' gradients are summed into a host gradient)
    only_gpu = hosts > 1 or set(options.reductions) == {GPU}
    problem = replace(problem, grads_streamable=grads_streamable and (world_size == 1 or only_gpu),
                      early_in_place=grads_streamable, vocab_chunk_numel=options.vocab_chunk_numel)
    model_costs, sol, vocab_tried = _vocab_search(problem, options, budget_bytes, host_budget_bytes)
    costs = model_costs.variant(sol.decisions)  # the problem with the chosen tables streamed
    wall = time.perf_counter() - t0
    tick = costs.scale.tick_s
    solver = {
        "method": "cp-sat",
        "ortools_version": package_version("ortools"),
        "status": sol.status,
        "chosen_by": sol.chosen_by,
        "objective_s": sol.makespan * tick,
        "best_bound_s": sol.bound * tick,
        "relative_gap": (sol.makespan - sol.bound) / sol.makespan if sol.makespan else 0.0,
        "tick_s": tick,
        "windows": [{"window": r.window, "status": r.status,
                     "objective_s": None if r.objective is None else r.objective * tick,
                     "best_bound_s": None if r.best_bound is None else r.best_bound * tick,
                     "deterministic_time": round(r.deterministic_time, 6), "conflicts": r.conflicts,
                     "branches": r.branches, "variables": r.n_variables, "constraints": r.n_constraints}
                    for r in sol.windows],
        "candidates": _candidates(sol.candidates, tick),
        "lower_bound_s": sol.lower_bound * tick,
        "min_budget_bytes": sol.min_budget_bytes,
        "seed": costs.options.seed,
        "workers": costs.options.workers,
        "deterministic_time_limit": sol.deterministic_time_limit,
        "gap_explained": sol.gap_explained,
        "streamed_tried": {str(k): step_s for k, step_s in sol.streamed_tried.items()},
        "vocab_streamed_tried": vocab_tried if vocab_tried is not None else {},
        "wall_s": wall,
        "searches": {**_searches(sol, model_costs), **_vocab_searched(vocab_tried, model_costs, sol)},
    }
    if host_budget_bytes is not None:
        solver["host_budget_bytes"] = int(host_budget_bytes)
    plan = plan_for(costs, sol.decisions, budget_bytes=budget_bytes, precision=precision, version=version,
                    solver=solver, explain=explain)
    assert host_budget_bytes is None or plan.peak_host_bytes <= host_budget_bytes, (plan.host_memory, host_budget_bytes)
    if explain and len(sol.streamed_tried) > 1 and len(plan.streamed_updates) in sol.streamed_tried:
        plan = plan.replace(alternatives=plan.alternatives + (
            _streamed_alternative(sol.streamed_tried, len(plan.streamed_updates), _polished(sol.chosen_by)),))
    return plan


def _candidates(candidates, tick: float) -> dict[str, float]:
    """Each heuristic's fastest step [s] (one name may run once per choice of streamed tables)."""
    best: dict[str, float] = {}
    for name, ticks in candidates:
        best[name] = min(best.get(name, ticks * tick), ticks * tick)
    return best


def _made_by(sol: Solution, how_cp_sat: str = "") -> str:
    """Credit for the decisions of the model: CP-SAT where its decisions won, else the heuristic
    whose decisions it did not better (ties credit the heuristic)."""
    core = sol.chosen_by.split(" + ")[0]
    return "CP-SAT" + how_cp_sat if core == "cp-sat" else f"{core} (a heuristic; CP-SAT found nothing better)"


def _searches(sol: Solution, costs: ProblemCosts) -> dict[str, str]:
    """Which search made which decisions of the plan (a decision not made by CP-SAT is not credited to
    it): the delivery copies and the placement of the optimizer state where they are decisions of the
    model (ProblemCosts.copyable, Problem.device_state_optional)."""
    options, problem = costs.options, costs.problem
    decisions = "window, chunks, activations, routes, update owners" + (", delivery copies" if costs.copyable else "")
    made = _made_by(sol)
    searches = {decisions: made}
    if problem.device_state_optional:
        searches["optimizer state on the device"] = made + (
            "; the prologue's fixed by SolverOptions.device_state_prologue"
            if options.device_state_prologue is not None and problem.graph.prologue.id not in
            problem.device_state_optional else "")
    elif options.device_state_blocks is not None:
        searches["optimizer state on the device"] = "fixed by SolverOptions.device_state_blocks"
    polish = _polished(sol.chosen_by)
    if polish:
        searches[f"{polish}, changed last"] = ("local search from the decisions above, judged by the simulator "
                                               "(search/local_search.py)")
    if problem.device_state_sharded and sol.decisions.device_state:
        searches["device state sharded by chunk owner"] = (
            "fixed by SolverOptions.device_state_sharded" if options.device_state_sharded
            else "the default with several ranks (SolverOptions.device_state_sharded=False keeps a full copy "
                 "on every rank)")
    if problem.grads_streamable:
        streamed = "gradients streamed into the update" if sol.decisions.grads_streamed else \
            "gradients kept to the step boundary"
        # streamed updates (a sweep, or fixed by the options) need the gradients kept
        searches[streamed] = "with the streamed updates" if sol.decisions.streamed else made
    if sol.decisions.early_order and not sol.decisions.grads_streamed:
        searches["early updates"] = "simulation of the update order (search/early_order.py)"
    if sol.decisions.streamed:
        searches["streamed updates"] = ("fixed by SolverOptions.streamed_layers" if options.streamed_layers is not None
                                        else "sweep by simulation (search/streamed_prefix.py)")
    return searches


def _polished(chosen_by: str) -> str:
    """The decision families the final local search changed ("" if none)."""
    last = chosen_by.split(" + ")[-1]
    return last[len("local search ("):-1] if last.startswith("local search (") else ""


def _streamed_alternative(tried: dict[int, float], chosen: int, polished: str = "") -> Alternative:
    """The number of host layers whose update is streamed through the device, against the best other
    (as the sweep found them: before the final local search, when it changed `polished`)."""
    other = min((k for k in tried if k != chosen), key=lambda k: (tried[k], k))
    why = ("each streamed layer's update leaves the CPU, whose AdamW the next forward waits for, but its "
           "state crosses PCIe both ways (14 bytes per parameter each way) before the forward may load it")
    if polished:
        why += f"; times from the sweep, before the final local search changed the {polished}"
    return Alternative("streamed updates", f"{chosen} layers", f"{other} layers", tried[chosen], tried[other], 0,
                       f"{chosen} layers: {tried[chosen] * 1e3:.1f} ms; {other} layers: {tried[other] * 1e3:.1f} ms. "
                       f"{why}")


def _vocab_label(problem: Problem, streamed) -> str:
    """"none", "prologue", "epilogue" or "prologue + epilogue" (with " (tied table)" where they share
    it): the layers whose table streams."""
    g = problem.graph
    label = " + ".join(n for n, i in (("prologue", g.prologue.id), ("epilogue", g.epilogue.id)) if i in streamed)
    return (label + (" (tied table)" if g.tied_table is not None else "")) if label else "none"


def _vocab_choices(problem: Problem, options: SolverOptions) -> list[frozenset]:
    """The sets of layers whose vocabulary table may stream (Problem.vocab_streamed), resident first.

    A table streams where LayerGraph.vocab_sets allows (untied, each layer on its own; tied, both
    layers or neither), whatever its layer's routes (its row chunks follow the replicated or sharded
    delivery and the CPU or GPU reduction: backend/runtime/routes.py, several hosts included); not a
    layer the options put on the device. options.vocab_streamed fixes the set."""
    g = problem.graph
    sets = g.vocab_sets()
    ids = {"prologue": g.prologue.id, "epilogue": g.epilogue.id}
    if options.vocab_streamed is not None:
        fixed = frozenset(ids[n] for n in options.vocab_streamed)
        if fixed not in sets:
            raise ValueError(f"SolverOptions.vocab_streamed names {sorted(options.vocab_streamed)}, whose vocabulary "
                             "table cannot stream so (no [vocab, hidden] parameter, a head that is not a bias-free "
                             "nn.Linear, or a tied table named for one layer only: it streams for both)")
        return [fixed]
    off = set()  # layers the options put on the device
    if options.device_state_prologue:
        off.add(g.prologue.id)
    if options.device_state_blocks is not None and options.device_state_blocks > problem.n_blocks:
        off.add(g.epilogue.id)
    return [choice for choice in sets if not choice & off]


def _vocab_search(problem: Problem, options: SolverOptions, budget_bytes: int, host_budget: int | None):
    """Which tables stream (_vocab_choices): a decision of the CP-SAT model (Problem.vocab_choices: a
    Boolean per table, one for a tied table), solved once with the placement of the optimizer state
    `_placement_problem` allows. Streaming a table takes it (and its fp32 gradient) off the device for
    the whole step, which every other decision's memory sees, at the price of a second load of the head
    and the recomputation of its logits (costs.py): the model prices both (ProblemCosts.variants).

    Where the options fix the set, or a tied table could stream while the gradients may stream into
    the update (which a streamed tied table's gradient, the sum of two uses, cannot), each choice is
    solved in full and the fastest kept (ties: the earlier, resident first); below every choice's
    smallest budget, the error names the smallest of them. Returns the costs the model was built on,
    its solution, and {label: predicted step [s] or None (does not fit)} of such a sweep (None where the
    model chose)."""
    choices = _vocab_choices(problem, options)
    tied_grads = problem.grads_streamable and problem.graph.tied_table is not None
    if len(choices) > 1 and not tied_grads:
        costs = ProblemCosts(_placement_problem(replace(problem, vocab_choices=tuple(choices)), options, host_budget),
                             options)
        return costs, solve(costs, budget_bytes), None
    best, errors, tried, bounds = None, [], {}, {}
    for choice in choices:
        label = _vocab_label(problem, choice)
        try:
            costs = ProblemCosts(_placement_problem(problem.with_vocab_streamed(choice), options, host_budget), options)
            sol = solve(costs, budget_bytes)
        except InfeasibleBudgetError as e:
            errors.append(e)
            tried[label] = None
            continue
        tried[label] = sol.makespan * costs.scale.tick_s
        bounds[label] = (sol.bound * costs.scale.tick_s, sol.gap_explained)
        if best is None or tried[label] < best[0]:
            best = (tried[label], costs, sol)
    if best is None:  # the host is too small for every choice the device budget fits, else the device is
        host = [e for e in errors if e.min_budget_bytes <= budget_bytes]
        raise (min(host, key=lambda e: e.min_host_bytes or 0) if host else min(errors, key=lambda e: e.min_budget_bytes))
    _, costs, sol = best
    # the plan's bound is the lowest of every choice's: another choice may not be proven slower
    label, (bound_s, words) = min(bounds.items(), key=lambda kv: kv[1][0])
    if bound_s < sol.bound * costs.scale.tick_s:
        sol = replace(sol, bound=math.floor(bound_s / costs.scale.tick_s), status="FEASIBLE",
                      gap_explained=f"each choice of the streamed tables solved in full, the lowest bound that of "
                                    f"{label}, {bound_s * 1e3:.4g} ms: {words}")
    return costs, sol, tried


def _vocab_searched(tried: dict | None, costs: ProblemCosts, sol: Solution) -> dict[str, str]:
    """The plan's credit for the vocabulary decision (solver["searches"]): the search whose decisions the
    plan holds where the CP-SAT model chose (a decision not made by CP-SAT is not credited to it)."""
    label = _vocab_label(costs.problem, costs.vocab_set(sol.decisions) if costs.variants else costs.problem.vocab_streamed)
    if tried is None:
        how = _made_by(sol, " (a Boolean per table, one for a tied table)")
    elif len(tried) < 2:
        how = "fixed by SolverOptions.vocab_streamed" if costs.options.vocab_streamed is not None else \
            "the only choice (no table that can stream)"
    else:
        how = (f"sweep around the solver (a tied table whose gradient could otherwise stream into the update): "
               f"{len(tried)} choices, each solved in full (solve._vocab_search); "
               + ", ".join(f"{k}: {'does not fit' if v is None else f'{v * 1e3:.1f} ms'}" for k, v in tried.items()))
    return {f"streamed vocabulary ({label})": how}


def _placement_problem(problem: Problem, options: SolverOptions, host_budget: int | None) -> Problem:
    """The problem with the layers whose optimizer state is fixed on the device (Problem.device_state)
    or placed by the CP-SAT model (Problem.device_state_optional), its sharding, and the host budget.

    A layer's state on the device takes its device memory for good (costmodel.memory.device_state_bytes)
    that the other decisions (window, kept activations) no longer have; in exchange its weights never
    cross PCIe and its update leaves the CPU, which is what bounds a step once the host's DRAM is busy;
    the prologue's (often a large embedding table) is updated first in the next step, before anything
    on the GPU can start. With one rank its layer takes no host RAM, which a host budget may need. With
    several ranks the state is sharded by chunk owner unless options.device_state_sharded is False:
    each rank keeps and updates the chunks it owns (about 1/W of the bytes), their gradient
    reduce-scattered and their weights all-gathered at each load; False keeps the same full copy on
    every rank (gradient all-reduced, the same update everywhere); several hosts keep it whole.
    options.device_state_blocks fixes the first that many blocks (then the epilogue) and, with
    device_state_prologue, the prologue; device_state_prologue alone fixes the prologue's. Without
    either, every layer with parameters whose table does not stream may go there, where the device's
    memory bandwidth is known (and, with several ranks, the GPUs reach each other directly)."""
    g = problem.graph
    W = problem.world_size
    eligible = [layer.id for layer in g.layers if layer.numel and layer.id not in problem.vocab_streamed]
    # the head last, after every block; never a table that streams
    candidates = [b.id for b in g.blocks] + ([g.epilogue.id] if g.epilogue.id in eligible else [])
    prologue = g.prologue.id
    hw = problem.hardware
    fixed_k, fixed_prologue = options.device_state_blocks, options.device_state_prologue
    forced, optional = frozenset(), frozenset()
    if fixed_k is not None:
        if fixed_k > len(candidates):
            raise ValueError(f"device_state_blocks={fixed_k}, but the model has {len(g.blocks)} blocks "
                             f"(and {len(candidates) - len(g.blocks)} epilogue with parameters)")
        forced = frozenset(candidates[:fixed_k]) | ({prologue} if fixed_prologue and prologue in eligible else set())
    elif hw.gpu_memory_bytes_per_s > 0 and (W == 1 or hw.gpu_p2p_bytes_per_s > 0):
        optional = frozenset(candidates)
        if prologue in eligible and fixed_prologue:
            forced = frozenset({prologue})
        elif prologue in eligible and fixed_prologue is None:
            optional |= {prologue}
    # several hosts: every host keeps device-state layers whole (run/launch.py), so a full copy per rank
    sharded = W > 1 and problem.hosts == 1 and options.device_state_sharded is not False
    p = replace(problem, device_state=forced, device_state_optional=optional,
                device_state_sharded=sharded and bool(forced | optional), host_budget_bytes=host_budget)
    if host_budget is not None:
        p = replace(p, copies_on_load=copies_may_bind(p, options, host_budget))
    return p


def copies_may_bind(problem: Problem, options: SolverOptions, host_budget: int) -> bool:
    """Whether making a delivery copy on load can matter: the host budget is below what the plan could
    take with every copy kept (its fixed part, every block's activations (or input) offloaded, early updates'
    spare state; placing optimizer state on the device takes host RAM away, but for the lean layers'
    staging). Otherwise keeping them is never worse (a load made from the fp32 master moves twice
    the bytes) and the choice is left out of the model."""
    kept = replace(problem, copies_on_load=False)
    most = host_fixed_bytes(kept, options)
    if problem.device_state_optional and problem.world_size == 1 and not problem.device_state:
        most += mem.load_staging_bytes(problem.device_state_optional)
    boundary = max(layer.costs.boundary_activation_bytes for layer in problem.graph.layers)  # costs.boundary_bytes
    offloaded = [max(b.costs.saved_activation_bytes if OFFLOAD in options.activations else 0,
                     boundary if RECOMPUTE_OFFLOAD in options.activations else 0) for b in problem.graph.blocks]
    most += problem.ranks_per_host * problem.micro_batches * sum(offloaded)
    if problem.early_host_bytes is not None:
        most += sum(mem.host_spare_bytes(layer.numel) for layer in problem.graph.layers)
    if problem.grads_streamable:  # the fixed part counts no gradient where they may stream
        most += sum(mem.host_grad_bytes(layer.numel, mem.DTYPE_BYTES[problem.graph.compute_dtype])
                    for layer in problem.graph.layers)
    return host_budget < most


def _largest_terms(breakdown: dict) -> str:
    items = sorted(breakdown.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in items)


# -- emit ------------------------------------------------------------------------------------------


def plan_for(costs: ProblemCosts, decisions: Decisions, *, budget_bytes: int, precision: str, version: str,
             solver: dict, notes: tuple[str, ...] = (), explain: bool = True) -> Plan:
    """The Plan of some decisions: simulated on every rank, with timeline, memory and reasons."""
    problem, g = costs.problem, costs.problem.graph
    sim = simulate(costs, decisions, record=True)
    tick = sim.tick_s
    order = decisions.order(costs.n_layers)
    position = {layer: p for p, layer in enumerate(order)}
    layer_decisions = tuple(
        LayerDecision(layer.id, layer.name, layer.kind, layer.numel, c.chunks, c.activation, c.delivery, c.reduction,
                      owners=tuple(costs.owner(position[layer.id], k) for k in range(c.chunks)),
                      host_copy=c.host_copy)
        for layer, c in zip(g.layers, decisions.layers))
    busy = {lane: sim.lane_busy.get(lane, 0) * tick for lane in (COMPUTE, H2D, D2H, COLLECTIVE, CPU_UPDATE)}
    bottleneck = max(busy, key=busy.get)
    predicted = {
        "step_s": sim.step_s, "compute_s": busy[COMPUTE], "h2d_s": busy[H2D], "d2h_s": busy[D2H],
        "collective_s": busy[COLLECTIVE], "cpu_update_s": busy[CPU_UPDATE],
        "exposed_s": sim.step_s - busy[bottleneck], "bottleneck": bottleneck,
    }
    timeline = tuple(TimelineEvent(e.rank, e.lane, e.name, e.layer, e.chunk, e.start * tick, e.end * tick)
                     for e in sim.events)
    starts = (0,) + sim.compute_starts[1:]
    memory_timeline = tuple(MemoryPoint(t * tick, sim.footprint.per_position[x], sim.pinned_host_bytes[x])
                            for x, t in enumerate(starts))
    auto_notes = [
        "streamed gradients: each chunk of a host layer's gradient updates it in place from the staging buffer "
        "it lands in (no gradient kept in host RAM, no spare state); a non-finite gradient stops training "
        "(nonfinite='stop'), the state part-updated"
        if decisions.grads_streamed else
        "early updates: each host layer's update starts once its gradient has landed (early_order), in place "
        "(no spare state); a non-finite gradient stops training (nonfinite='stop'), the state part-updated; "
        "the next step's loads wait for their layer's update"
        if decisions.early_order and problem.early_in_place else
        "early updates: each host layer's update starts once its gradient has landed (early_order), out of "
        "place, kept once the whole gradient is finite; the next step's loads wait for their layer's update"
        if decisions.early_order else
        "step boundary: the step starts once every gradient of the previous step is on the host; the CPU "
        "then updates the layers in update_order while this step's loads wait for their layer's update",
        *(["streamed updates: at the step boundary the device updates the streamed_updates layers, their "
           "fp32 state up and back down ahead of every load of the step; each one's loads wait for its "
           "last piece down"] if decisions.streamed else []),
        f"loss computed {problem.effective_loss_chunk_tokens} tokens at a time" if g.linear_head else
        f"loss computed by the model's own forward on a micro-batch's whole logits "
        f"({problem.effective_loss_chunk_tokens} tokens): its logits are not its head's plain output (scaled, "
        "capped or copied), so the loss is not fused and the head does not stream",
    ]
    if g.blocks:
        host_s, device_s = ops.block_host_and_device_s(g.blocks[0].costs, problem.hardware,
                                                       compiled=problem.compiled_blocks)
        if host_s > device_s:
            auto_notes.append(f"blocks host-bound: a block's forward and backward of one micro-batch take the host "
                              f"{host_s * 1e3:.2f} ms to issue and the device {device_s * 1e3:.2f} ms; micro-batches "
                              "of more rows spread the host's time over more tokens (group_rows lets the plan choose "
                              "how many)")
    if any(d.activation in (KEEP, OFFLOAD) for d in decisions.layers[1:-1]):
        auto_notes.append("kept and offloaded activations counted " + (
            "as the compiled block's graph saves them (AOTAutograd's min-cut partitioner)"
            if g.saved_bytes_method == "aot-min-cut" else "as eager autograd saves them"))
    if problem.hosts > 1:
        auto_notes.append(f"{problem.hosts} hosts of {problem.ranks_per_host} rank(s): every host layer delivered "
                          "sharded and reduced on the GPUs (a rank reads from its host only what its host updates); "
                          "each host holds and updates only the chunks its ranks own; collectives "
                          f"between hosts at {problem.link_bytes_per_s / 1e9:.1f} GB/s per host")
    elif costs.options.forces_route:
        auto_notes.append(f"routes forced by the solver options: deliveries {costs.options.deliveries}, "
                          f"reductions {costs.options.reductions}" + (
                              "; without GPU peer-to-peer their collectives go through host memory"
                              if problem.hardware.gpu_p2p_bytes_per_s <= 0 else ""))
    elif problem.world_size > 1 and problem.hardware.gpu_p2p_bytes_per_s <= 0:
        auto_notes.append("no GPU peer-to-peer: sharded delivery and GPU reduction are not considered")
    if any(c.delivery == SHARDED or c.reduction == GPU for c in decisions.layers):
        auto_notes.append("with sharded delivery or GPU reduction, rank r copies and updates the chunks it owns")
    host = costs.host_memory(decisions)
    groups = group_predictions(costs, decisions, sim) if explain else ()
    alts = alternatives(costs, decisions, sim, budget_bytes) if explain else ()
    schedule = Schedule(
        window=decisions.window,
        decisions=layer_decisions,
        window_loads=window_loads(costs.n_blocks, decisions.window),
        update_order=order,
        device_state=tuple(sorted(decisions.device_state)),
        device_state_sharded=problem.device_state_sharded and bool(decisions.device_state),
        early_order=decisions.early_order,
        streamed_gradients=decisions.grads_streamed,
        early_in_place=problem.early_in_place and bool(decisions.early_order) and not decisions.grads_streamed,
        streamed_updates=decisions.streamed,
        loss_chunk_tokens=problem.effective_loss_chunk_tokens,
        vocab_chunk_rows=problem.vocab_chunk_rows if problem.vocab_streamed else 0,
    )
    explanation = Explanation(
        solver=solver,
        predicted=predicted,
        memory=dict(sim.footprint.breakdown),
        peak_device_bytes=sim.peak_bytes,
        notes=tuple(notes) + tuple(auto_notes),
        peak_host_bytes=sum(host.values()),
        host_memory=host,
        timeline=timeline,
        memory_timeline=memory_timeline,
        groups=groups,
        alternatives=alts,
        critical_path=tuple(sim.events[i].name for i in sim.critical_path),
    )
    return Plan(
        schema_version=SCHEMA_VERSION,
        slidedp_version=version,
        model_fingerprint=g.fingerprint(),
        model_class=g.model_class,
        workload=Workload(g.batch_size, g.seq_len, problem.world_size, precision, problem.micro_batches,
                          problem.compiled_blocks, problem.hosts, problem.link_bytes_per_s),
        budget_bytes=int(budget_bytes),
        hardware=problem.hardware.to_dict(),
        schedule=schedule,
        explanation=explanation,
    )


def fixed_plan(graph: LayerGraph, decide, *, method: str, budget_bytes: int, hardware: Hardware, world_size: int,
               precision: str, micro_batches: int, loss_chunk_tokens: int = 4096,
               options: SolverOptions | None = None, version: str = "0", compiled_blocks: bool = False,
               hosts: int = 1, link_bytes_per_s: float = 0.0, vocab_streamed: frozenset = frozenset(),
               vocab_chunk_numel: int | None = None) -> Plan:
    """The plan of a baseline rule `decide(costs, budget) -> Decisions | None` (no search);
    `vocab_streamed`: the layer ids whose vocabulary table streams (Problem.vocab_streamed)."""
    problem = Problem(graph, hardware, world_size, micro_batches, loss_chunk_tokens, compiled_blocks,
                      hosts=hosts, link_bytes_per_s=link_bytes_per_s, vocab_streamed=frozenset(vocab_streamed),
                      **({} if vocab_chunk_numel is None else {"vocab_chunk_numel": vocab_chunk_numel}))
    costs = ProblemCosts(problem, options)
    decisions = decide(costs, budget_bytes)
    if decisions is None:
        min_budget, min_decisions, _, _ = minimum_budget(costs)
        needs = baselines.peak_bytes(costs, baselines.uniform(costs, window=1, activation="recompute"))
        raise InfeasibleBudgetError(
            f"the {method} schedule does not fit the device budget {format_bytes(budget_bytes)} (it needs "
            f"{format_bytes(needs)}); the solver can plan from {format_bytes(min_budget)} ({min_budget} bytes)",
            min_budget_bytes=min_budget, budget_bytes=budget_bytes)
    return plan_for(costs, decisions, budget_bytes=budget_bytes, precision=precision, version=version,
                    solver={"method": method, "status": "FIXED"})


def default_plan(
    graph: LayerGraph, *, budget_bytes: int, hardware: Hardware, world_size: int, precision: str,
    micro_batches: int, version: str,
) -> Plan:
    """The fixed baseline: one chunk per rank per layer, every block recomputed, window 2 (else 1)."""
    return fixed_plan(graph, baselines.default_decisions, method="default", budget_bytes=budget_bytes,
                      hardware=hardware, world_size=world_size, precision=precision, micro_batches=micro_batches,
                      version=version)
