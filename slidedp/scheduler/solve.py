"""Planning: the smallest feasible budget, the baselines, CP-SAT per window, the best of all of
them, and the Plan (decode -> simulate -> emit).

The plan returned is never slower than a baseline that fits (they are all simulated with the same
oracle and the fastest wins), and CP-SAT's objective for the decisions it returns equals their
simulated step time (asserted in cpsat.solve_window).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version as package_version

from slidedp.budget import format_bytes
from slidedp.costmodel import memory as mem
from slidedp.costmodel.hardware import Hardware
from slidedp.errors import InfeasibleBudgetError
from slidedp.ir.graph import LayerGraph
from slidedp.scheduler.search import baselines, cpsat, early_order, local_search, streamed_prefix
from slidedp.scheduler.search.found import Found, fastest
from slidedp.scheduler.problem.costs import ProblemCosts, host_fixed_bytes, host_fixed_memory
from slidedp.scheduler.decisions import GPU, KEEP, OFFLOAD, RECOMPUTE_OFFLOAD, SHARDED, Decisions, Problem, SolverOptions
from slidedp.scheduler.explain import alternatives, group_predictions
from slidedp.scheduler.plan import (
    SCHEMA_VERSION, Alternative, Explanation, LayerDecision, MemoryPoint, Plan, Schedule, TimelineEvent, Workload,
)
from slidedp.scheduler.problem.lanes import COLLECTIVE, COMPUTE, CPU_UPDATE, D2H, H2D, window_loads
from slidedp.scheduler.oracles.timeline import simulate

log = logging.getLogger("slidedp")


def minimum_budget(costs: ProblemCosts) -> tuple[int, Decisions, dict[int, int], int]:
    """The smallest budget with which planning succeeds: the least peak over every decision (a
    CP-SAT solve at the smallest window), decisions reaching it, the least budget of each window
    (a lower bound), and the proven lower bound of the least peak (the peak itself where CP-SAT
    proves it minimal). The window only adds its slots (footprint.py), so each window's minimum is
    the smallest one plus (window - smallest) slots."""
    windows = costs.windows()
    peak, bound, decisions = cpsat.minimum_peak(costs, windows[0])
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


def _device_too_small(costs: ProblemCosts, budget_bytes: int, min_budget: int, min_decisions: Decisions,
                      host_budget: int | None = None) -> InfeasibleBudgetError:
    """The error of a device budget below the smallest schedule's peak (with the host bytes of that
    schedule's problem: a plan needs them too)."""
    sim = simulate(costs, min_decisions, all_ranks=False)
    min_host = host_fixed_bytes(costs.problem, costs.options)
    return InfeasibleBudgetError(
        f"the device budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the "
        f"{format_bytes(min_budget)} ({min_budget} bytes) that the smallest schedule needs "
        f"({_largest_terms(sim.footprint.breakdown)}); give at least {min_budget} bytes, or plan fewer "
        f"micro-batches or a smaller batch (host memory: that schedule needs at least "
        f"{format_bytes(min_host)}, {min_host} bytes)",
        min_budget_bytes=min_budget, budget_bytes=budget_bytes, min_host_bytes=min_host, host_budget_bytes=host_budget)


def solve(costs: ProblemCosts, budget_bytes: int) -> Solution:
    """Plan one problem: the smallest budget, the heuristics, CP-SAT per window, the best of all.

    Raises InfeasibleBudgetError below the smallest budget that any decisions fit; its
    `min_budget_bytes` is the least simulated peak over every decision (exact where CP-SAT proves
    it; else the least it found, and a budget between its proven bound and that is searched).
    """
    min_budget, min_decisions, min_per_window, min_bound = minimum_budget(costs)
    if budget_bytes < min_bound:
        raise _device_too_small(costs, budget_bytes, min_budget, min_decisions)

    # Heuristics: the baselines that fit, the least-memory decisions (which fit unless the budget is
    # below the least peak found and above its proven bound), and a local search from each of the two
    # best distinct ones.
    candidates = [f for f in (baselines.strategy(name)(costs, budget_bytes) for name in baselines.BASELINES) if f]
    if min_budget <= budget_bytes:
        candidates.append(Found("least-memory", min_decisions, simulate(costs, min_decisions, all_ranks=False)))
    starts: list[Decisions] = []
    for f in sorted(candidates, key=lambda f: f.makespan):
        if f.decisions not in starts:
            starts.append(f.decisions)
    for k, d in enumerate(starts[:2]):
        candidates.append(local_search.search(costs, budget_bytes, d, name=f"local-search-{k + 1}"))
    incumbent = fastest(candidates)

    # CP-SAT, one model per window that can fit (large models: the incumbent's window only), each
    # started from the best candidate of its window. Skipped when the incumbent meets the bound.
    lower = cpsat.lower_bound(costs)
    feasible_windows = [w for w in costs.windows() if min_per_window[w] <= budget_bytes]
    small = costs.n_blocks <= costs.options.all_windows_up_to_blocks
    if incumbent is not None and incumbent.makespan <= lower:
        windows = []
    else:
        windows = feasible_windows if small or incumbent is None else [incumbent.decisions.window]
    budget_each = 0.0
    if windows:
        budget_each = (costs.options.deterministic_time / len(windows) if small
                       else costs.options.large_deterministic_time)
    results, solved = [], []
    for w in windows:
        hint = fastest([c for c in candidates if c.decisions.window == w])
        if hint is not None:
            hint_d = hint.decisions
        elif incumbent is not None and baselines.peak_bytes(costs, replace(incumbent.decisions, window=w)) <= budget_bytes:
            hint_d = replace(incumbent.decisions, window=w)
        else:
            hint_d = replace(min_decisions, window=w)
        found, result = cpsat.search(costs, budget_bytes, hint_d, window=w, deterministic_time=budget_each)
        results.append(result)
        solved += [found] if found is not None else []
    best = fastest(candidates + solved)  # a tie credits the heuristic: CP-SAT found nothing better
    if best is None:  # a budget within the least-peak model's gap, and nothing found that fits it
        raise _device_too_small(costs, budget_bytes, min_budget, min_decisions)
    chosen_by, decisions, best_sim = best.by, best.decisions, best.simulation
    assert best_sim.peak_bytes <= budget_bytes, (chosen_by, best_sim.peak_bytes, budget_bytes)
    # Early updates (if allowed) take the chosen decisions' CPU work into the backward; the search
    # above models the step boundary, so its bound is not one for them: the analytical one is.
    # Where the gradients may stream into the update, CP-SAT's host budget counts none of them: the
    # decisions that keep them must also fit with them, else they stream.
    early = early_order.search(costs, budget_bytes, decisions)
    kept_fits = costs.fits(decisions, best_sim.peak_bytes, budget_bytes)
    if early is not None and (early.makespan < best_sim.makespan or not kept_fits):
        decisions, best_sim = early.decisions, early.simulation
        chosen_by += f" + {early.by}"
        results = [replace(r, best_bound=None) for r in results]
        lower = cpsat.lower_bound(costs, early=True)
    # Streamed updates (if allowed): the device takes the first host layers' updates off the CPU.
    streamed = streamed_prefix.search(costs, budget_bytes, decisions)
    streamed_tried = streamed.tried if streamed is not None else {}
    fixed = costs.options.streamed_layers is not None
    if streamed is not None and (fixed or streamed.makespan < best_sim.makespan):
        decisions, best_sim = streamed.decisions, streamed.simulation
        chosen_by += " + streamed updates"
        results = [replace(r, best_bound=None) for r in results]
        lower = cpsat.lower_bound(costs, streamed=True)
    # The searches above judge window, chunks, activations, routes and update order at the step
    # boundary, and a time-limited CP-SAT may stop short: descend from the final decisions by
    # whole-group moves (the ones the plan's alternatives are compared with), crediting what it changes.
    polished = local_search.search(costs, budget_bytes, decisions, name="local search")
    if polished.makespan < best_sim.makespan:
        changed = local_search.changed(decisions, polished.decisions)
        decisions, best_sim = polished.decisions, polished.simulation
        chosen_by += f" + local search ({', '.join(changed)})"

    best_ticks = best_sim.makespan
    bounds = {w: lower for w in feasible_windows}
    for r in results:
        if r.status == "INFEASIBLE":
            bounds.pop(r.window, None)
        elif r.best_bound is not None:
            bounds[r.window] = max(lower, r.best_bound)
    bound = min(min(bounds.values(), default=best_ticks), best_ticks)
    return Solution(decisions, best_ticks, bound, "OPTIMAL" if bound == best_ticks else "FEASIBLE", chosen_by,
                    tuple((f.by, f.makespan) for f in candidates), tuple(results), lower, min_budget,
                    budget_each * len(windows), streamed_tried)


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
    ranks: with the GPU reduction).
    `host_budget_bytes` (None: unbounded) bounds everything the plan takes of host RAM, all ranks
    together (Explanation.host_memory: host state, spare state, offloaded activations, pinned
    buffers): a hard constraint like the device budget (InfeasibleBudgetError with min_host_bytes).
    Which layers keep their optimizer state on the device: `_device_state_search`."""
    t0 = time.perf_counter()
    problem = Problem(graph, hardware, world_size, micro_batches, loss_chunk_tokens, compiled_blocks,
                      host_offload_bytes, early_host_bytes=early_host_bytes, streamed_updates=streamed_updates,
                      hosts=hosts, link_bytes_per_s=link_bytes_per_s)
    options = options or SolverOptions()
    # several ranks stream their gradients only where every route the plan may take reduces on the GPUs
    # (with the CPU reduction the ranks' gradients are summed into a host gradient)
    only_gpu = hosts > 1 or set(options.reductions) == {GPU}
    problem = replace(problem, grads_streamable=grads_streamable and (world_size == 1 or only_gpu),
                      vocab_chunk_numel=options.vocab_chunk_numel)
    costs, sol, tried, vocab_tried = _vocab_search(problem, options, budget_bytes, host_budget_bytes)
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
        "candidates": {name: ticks * tick for name, ticks in sol.candidates},
        "lower_bound_s": sol.lower_bound * tick,
        "min_budget_bytes": sol.min_budget_bytes,
        "seed": costs.options.seed,
        "workers": costs.options.workers,
        "deterministic_time_limit": sol.deterministic_time_limit,
        "device_state_tried": {_device_state_label(c): step_s for c, step_s in sorted(tried.items())},
        "streamed_tried": {str(k): step_s for k, step_s in sol.streamed_tried.items()},
        "vocab_streamed_tried": vocab_tried,
        "wall_s": wall,
        "searches": {**_searches(sol, tried, costs.options, sharded=costs.problem.device_state_sharded,
                                 copies=bool(costs.copyable)),
                     **_vocab_searched(vocab_tried, costs)},
    }
    if host_budget_bytes is not None:
        solver["host_budget_bytes"] = int(host_budget_bytes)
    plan = plan_for(costs, sol.decisions, budget_bytes=budget_bytes, precision=precision, version=version,
                    solver=solver, explain=explain)
    assert host_budget_bytes is None or plan.peak_host_bytes <= host_budget_bytes, (plan.host_memory, host_budget_bytes)
    if explain and len(tried) > 1:
        chosen = (graph.prologue.id in plan.device_state, len(set(plan.device_state) - {graph.prologue.id}))
        plan = plan.replace(alternatives=plan.alternatives + (_device_state_alternative(tried, chosen),))
    if explain and len(sol.streamed_tried) > 1 and len(plan.streamed_updates) in sol.streamed_tried:
        plan = plan.replace(alternatives=plan.alternatives + (
            _streamed_alternative(sol.streamed_tried, len(plan.streamed_updates), _polished(sol.chosen_by)),))
    return plan


def _searches(sol: Solution, device_state_tried: dict, options: SolverOptions, *,
              sharded: bool = False, copies: bool = False) -> dict[str, str]:
    """Which search made which decisions of the plan (a decision not made by CP-SAT is not credited to
    it). `copies`: the delivery copies were a decision of the model (ProblemCosts.copyable)."""
    core = sol.chosen_by.split(" + ")[0]
    decisions = "window, chunks, activations, routes, update owners" + (", delivery copies" if copies else "")
    searches = {decisions: "CP-SAT" if core == "cp-sat" else f"{core} (a heuristic; CP-SAT found nothing better)"}
    polish = _polished(sol.chosen_by)
    if polish:
        searches[f"{polish}, changed last"] = ("local search from the decisions above, judged by the simulator "
                                               "(search/local_search.py)")
    if options.device_state_blocks is not None:
        searches["optimizer state on the device"] = "fixed by SolverOptions.device_state_blocks"
    elif len(device_state_tried) > 1:
        searches["optimizer state on the device"] = (f"sweep around the solver: {len(device_state_tried)} choices, "
                                                     "each solved in full (solve._device_state_search)")
    if sharded:
        searches["device state sharded by chunk owner"] = (
            "fixed by SolverOptions.device_state_sharded" if options.device_state_sharded
            else "the default with several ranks (SolverOptions.device_state_sharded=False keeps a full copy "
                 "on every rank)")
    if sol.decisions.grads_streamed:
        searches["gradients streamed into the update"] = ("simulation against the step boundary and early updates "
                                                          "(search/early_order.py)")
    elif sol.decisions.early_order:
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


def _device_state_label(choice: tuple[bool, int]) -> str:
    """"12 layers" or "prologue + 12 layers" for a (prologue, k) choice of the device-state search:
    the first k blocks (k past the last block counts the epilogue)."""
    prologue, k = choice
    return ("prologue + " if prologue else "") + f"{k} layers"


def _device_state_alternative(tried: dict[tuple[bool, int], float], chosen: tuple[bool, int]) -> Alternative:
    """The layers whose state lives on the device against the best other choice tried."""
    other = min((c for c in tried if c != chosen), key=lambda c: (tried[c], c[1], c[0]))
    why = ("each layer kept there takes its state's device memory for good, and takes its copies "
           "and its update off PCIe and the CPU; the prologue is the first layer the next step needs")
    a, b = _device_state_label(chosen), _device_state_label(other)
    return Alternative("optimizer state on the device", a, b, tried[chosen], tried[other], 0,
                       f"{a}: {tried[chosen] * 1e3:.1f} ms; {b}: {tried[other] * 1e3:.1f} ms. {why}")


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
    """Solve with each set of vocabulary-streamed layers (_vocab_choices), each in full (the device-state
    search and everything below it), and keep the fastest (ties: the earlier, resident first).

    Why a sweep: streaming a table takes it (and its fp32 gradient) off the device for the whole step,
    which every other decision's memory sees, at the price of a second load of the head and the
    recomputation of its logits (costs.py); so each choice is its own problem. Below every choice's
    smallest budget, the error names the smallest of them. A choice whose compute alone
    (cpsat.lower_bound) is no faster than the best step found is not solved. Returns the costs,
    solution and device states tried of the best choice, and {label: predicted step [s] or None (does
    not fit, or not solved)}."""
    best, errors, tried = None, [], {}
    # with the sharded delivery or the GPU reduction possible (several ranks with peer-to-peer, several
    # hosts) a streamed table is solved only where the resident ones do not fit: each full solve of
    # those route choices takes seconds of a large model
    plain = not options.forces_route and problem.hosts == 1 and (
        problem.world_size == 1 or problem.hardware.gpu_p2p_bytes_per_s <= 0)
    for choice in _vocab_choices(problem, options):
        label = _vocab_label(problem, choice)
        if best is not None and not plain and options.vocab_streamed is None:
            tried[label] = None
            continue
        if best is not None:  # skipped when its compute alone (a bound for every plan of it) is no faster
            costs = ProblemCosts(problem.with_vocab_streamed(choice), options)
            if cpsat.lower_bound(costs, streamed=True) * costs.scale.tick_s >= best[0]:
                tried[label] = None
                continue
        try:
            costs, sol, ds_tried = _device_state_search(problem.with_vocab_streamed(choice), options, budget_bytes,
                                                        host_budget)
        except InfeasibleBudgetError as e:
            errors.append(e)
            tried[label] = None
            continue
        tried[label] = sol.makespan * costs.scale.tick_s
        if best is None or tried[label] < best[0]:
            best = (tried[label], costs, sol, ds_tried)
    if best is None:  # the host is too small for every choice the device budget fits, else the device is
        host = [e for e in errors if e.min_budget_bytes <= budget_bytes]
        raise (min(host, key=lambda e: e.min_host_bytes or 0) if host else min(errors, key=lambda e: e.min_budget_bytes))
    _, costs, sol, ds_tried = best
    return costs, sol, ds_tried, tried


def _vocab_searched(tried: dict, costs: ProblemCosts) -> dict[str, str]:
    """The plan's credit for the vocabulary decision (solver["searches"])."""
    if len(tried) < 2:
        how = "fixed by SolverOptions.vocab_streamed" if costs.options.vocab_streamed is not None else \
            "the only choice (no table that can stream)"
    else:
        how = (f"sweep around the solver: {len(tried)} choices, each solved in full (solve._vocab_search); "
               + ", ".join(f"{k}: {'does not fit, cannot be faster or not solved' if v is None else f'{v * 1e3:.1f} ms'}"
                            for k, v in tried.items()))
    return {f"streamed vocabulary ({_vocab_label(costs.problem, costs.problem.vocab_streamed)})": how}


def _device_state_search(problem: Problem, options: SolverOptions, budget_bytes: int,
                         host_budget: int | None = None
                         ) -> tuple[ProblemCosts, Solution, dict[tuple[bool, int], float]]:
    """Solve with the optimizer state of the first k blocks (and maybe the prologue) on the device,
    for the best choice; k = blocks + 1 puts the epilogue's there too.

    Their master weights and moments take device memory for good (costmodel.memory.device_state_bytes)
    that the other decisions (window, kept activations) no longer have; in exchange their weights
    never cross PCIe and their update leaves the CPU, which is what bounds a step once the host's
    DRAM is busy. The prologue is worth its (often large) embedding table when the step is otherwise
    compute-bound: its CPU update comes first in the next step and nothing on the GPU can start before
    it. With several ranks the state is sharded by chunk owner unless options.device_state_sharded
    is False (the default: Problem.device_state_sharded): each rank keeps and updates the chunks it
    owns (about 1/W of the bytes, so W times as many layers fit), their gradient reduce-scattered and
    their weights all-gathered at each load; False keeps the same full copy on every rank (gradient
    all-reduced, the same update everywhere).
    options.device_state_blocks fixes k (and _prologue, default no, the prologue), _prologue alone
    fixes the family searched; with neither, nothing goes to the device unless its bandwidth is known
    (and, with several ranks, the GPUs reach each other directly). Then, without the prologue and
    (if it fits) with it, k is searched over k_min..k_max (k_max: the most whose state fits next to
    the smallest schedule; k_min: the fewest with which the host state fits `host_budget`, 0 without
    one): first k_min + (k_max - k_min) * (0, 1/4, 1/2, 3/4, 1), then the midpoints around the best,
    until neighbours are tried (ties: the smaller k, no prologue).

    The host budget is a hard constraint: a choice whose fixed host bytes (host state, which a
    of which a one-rank engine keeps nothing for the layers on the device, 16 bytes per parameter
    less in bf16, then the bounded staging of their state and the pinned buffers:
    problem.costs.host_fixed_bytes) exceed it is skipped, and the rest of the
    budget bounds the offloaded activations and early updates' spare state. No choice within both
    budgets: InfeasibleBudgetError naming the smallest of each (min_host_bytes: the leanest choice
    that fits the device budget).
    Returns the costs and solution of the best choice, and every (prologue, k) tried with its
    predicted step [s].
    """
    g = problem.graph
    prologue = g.prologue
    # the head last, after every block; never a table that streams
    candidates = list(g.blocks) + ([g.epilogue] if g.epilogue.numel and g.epilogue.id not in problem.vocab_streamed
                                   else [])
    results: dict[tuple[bool, int], tuple[ProblemCosts, Solution] | None] = {}  # None: does not fit
    searching = False
    W = problem.world_size
    # several hosts: every host keeps device-state layers whole (run/launch.py), so a full copy per rank
    sharded = W > 1 and problem.hosts == 1 and options.device_state_sharded is not False
    elem = mem.DTYPE_BYTES[g.compute_dtype]

    def state_bytes(layers) -> int:
        """Device-state bytes per rank of these layers (the busiest rank's shard when sharded)."""
        if not sharded:
            return mem.device_state_bytes(sum(layer.numel for layer in layers), elem)
        fewest = min(options.chunk_multiples) * W  # the largest chunks any option has
        return sum(mem.device_state_shard_bytes(layer.numel, elem, fewest, W) for layer in layers)

    def problem_of(choice: tuple[bool, int]) -> Problem:
        with_prologue, k = choice
        ids = frozenset(b.id for b in candidates[:k]) | ({prologue.id} if with_prologue else set())
        p = replace(problem, device_state=ids, device_state_sharded=sharded and bool(ids))
        if host_budget is None:
            return p
        p = replace(p, copies_on_load=copies_may_bind(p, options, host_budget))
        left = max(0, host_budget - host_fixed_bytes(p, options))
        per_rank = left // p.ranks_per_host
        return replace(p, host_offload_bytes=per_rank if p.host_offload_bytes is None else min(p.host_offload_bytes, per_rank),
                       early_host_bytes=None if p.early_host_bytes is None else min(p.early_host_bytes, left))

    def host_bytes(choice: tuple[bool, int]) -> int:
        return host_fixed_bytes(problem_of(choice), options)

    def host_fits(choice: tuple[bool, int]) -> bool:
        return host_budget is None or host_bytes(choice) <= host_budget

    def run(choice: tuple[bool, int], first: bool = False) -> None:
        if choice not in results and not first and not host_fits(choice):
            results[choice] = None  # its fixed host bytes alone exceed the host budget: not a choice
        if choice not in results:
            costs = ProblemCosts(problem_of(choice), options)
            try:
                results[choice] = costs, solve(costs, budget_bytes)
            except InfeasibleBudgetError as e:
                if first:
                    raise InfeasibleBudgetError(str(e), min_budget_bytes=e.min_budget_bytes, budget_bytes=budget_bytes,
                                                min_host_bytes=e.min_host_bytes, host_budget_bytes=host_budget) from None
                results[choice] = None  # its offloaded activations no longer fit the host: not a choice
                return
            if searching:
                log.info("plan: optimizer state of %s on the device: %.1f ms per step",
                         _device_state_label(choice), step_s(choice) * 1e3)

    def step_s(choice: tuple[bool, int]) -> float:
        if results.get(choice) is None:
            return float("inf")
        c, s = results[choice]
        return s.makespan * c.scale.tick_s

    def done(best: tuple[bool, int]):
        costs, sol = results[best]
        return costs, sol, {c: step_s(c) for c in results if results[c] is not None}

    def host_too_small(leanest: tuple[bool, int], min_budget: int) -> InfeasibleBudgetError:
        need = host_bytes(leanest)
        parts = host_fixed_memory(problem_of(leanest), options)
        return InfeasibleBudgetError(
            f"the host budget {format_bytes(host_budget)} ({host_budget} bytes) is below the {format_bytes(need)} "
            f"({need} bytes) that the leanest plan needs (host state {format_bytes(parts['state'])} with the "
            f"optimizer state of {_device_state_label(leanest)} on the device, pinned buffers "
            f"{format_bytes(parts['pinned_buffers'])}, the device state's staging {format_bytes(parts['load_staging'])}); "
            f"give host_memory at least {need} bytes, or a larger device "
            f"budget to keep more optimizer state on the device (the device budget {format_bytes(budget_bytes)} "
            f"needs at least {format_bytes(min_budget)}, {min_budget} bytes)",
            min_budget_bytes=min_budget, budget_bytes=budget_bytes, min_host_bytes=need, host_budget_bytes=host_budget)

    fixed_k, fixed_prologue = options.device_state_blocks, options.device_state_prologue
    if fixed_k is not None:
        if fixed_k > len(candidates):
            raise ValueError(f"device_state_blocks={fixed_k}, but the model has {len(g.blocks)} blocks "
                             f"(and {len(candidates) - len(g.blocks)} epilogue with parameters)")
        choice = (bool(fixed_prologue), fixed_k)
        run(choice, first=True)
        if not host_fits(choice):
            raise host_too_small(choice, results[choice][1].min_budget_bytes)
        return done(choice)
    if host_fits((False, 0)):
        run((False, 0), first=True)  # the least memory: raises InfeasibleBudgetError if nothing fits
        min_budget = results[(False, 0)][1].min_budget_bytes
    else:
        costs0 = ProblemCosts(problem_of((False, 0)), options)
        min_budget, min_decisions, _, min_bound = minimum_budget(costs0)
        if budget_bytes < min_bound:
            raise _device_too_small(costs0, budget_bytes, min_budget, min_decisions, host_budget)
    hw = problem.hardware
    if fixed_prologue is None and (hw.gpu_memory_bytes_per_s <= 0 or (
            problem.world_size > 1 and hw.gpu_p2p_bytes_per_s <= 0)):
        if results.get((False, 0)) is None:
            raise host_too_small((False, 0), min_budget)
        return done((False, 0))
    spare = budget_bytes - min_budget
    searching = True  # progress from here: a search takes several solves
    if results.get((False, 0)) is not None:
        log.info("plan: optimizer state of %s on the device: %.1f ms per step", _device_state_label((False, 0)),
                 step_s((False, 0)) * 1e3)
    families = [False, True] if fixed_prologue is None else [fixed_prologue]
    leanest: list[tuple[bool, int]] = [(False, 0)]  # the choice of each family with the least host memory
    for with_prologue in families:
        if with_prologue and prologue.id in problem.vocab_streamed:
            continue
        numel = prologue.numel if with_prologue else 0
        first = [prologue] if with_prologue else []
        if with_prologue and (numel == 0 or state_bytes(first) > spare):
            continue
        k_max = 0
        while k_max < len(candidates) and state_bytes(first + candidates[: k_max + 1]) <= spare:
            k_max += 1
        leanest.append((with_prologue, k_max))
        k_min = next((k for k in range(k_max + 1) if host_fits((with_prologue, k))), None)
        if k_min is None:
            continue  # no choice of this family fits the host budget
        if with_prologue:  # start where the blocks' best was, less the blocks the prologue's state displaces
            blocks_tried = [c for c in results if not c[0] and results[c] is not None]
            best = min(blocks_tried, key=lambda c: (step_s(c), c[1]))[1] if blocks_tried else k_max
            shift = round(numel / (sum(b.numel for b in g.blocks) / len(g.blocks)))
            starts = {k_max, max(k_min, min(k_max, best - shift))}
        else:
            starts = {k_min + round((k_max - k_min) * f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)}
        for k in sorted(starts):
            run((with_prologue, k))
        while True:
            tried = sorted(k for p, k in results if p == with_prologue)
            best = min(tried, key=lambda k: (step_s((with_prologue, k)), k))
            i = tried.index(best)
            todo = [k for k in ((tried[j] + best) // 2 for j in (i - 1, i + 1) if 0 <= j < len(tried))
                    if (with_prologue, k) not in results]
            if not todo:
                break
            for k in todo:
                run((with_prologue, k))
    feasible = [c for c in results if results[c] is not None]
    if not feasible:
        raise host_too_small(min(leanest, key=lambda c: (host_bytes(c), c[1], c[0])), min_budget)
    return done(min(feasible, key=lambda c: (step_s(c), c[1], c[0])))


def copies_may_bind(problem: Problem, options: SolverOptions, host_budget: int) -> bool:
    """Whether making a delivery copy on load can matter: the host budget is below what the plan could
    take with every copy kept (its fixed part, every block's activations (or input) offloaded, early updates'
    spare state). Otherwise keeping them is never worse (a load made from the fp32 master moves twice
    the bytes) and the choice is left out of the model."""
    kept = replace(problem, copies_on_load=False)
    most = host_fixed_bytes(kept, options)
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
        "early updates: each host layer's update starts once its gradient has landed (early_order), out of "
        "place, kept once the whole gradient is finite; the next step's loads wait for their layer's update"
        if decisions.early_order else
        "step boundary: the step starts once every gradient of the previous step is on the host; the CPU "
        "then updates the layers in update_order while this step's loads wait for their layer's update",
        *(["streamed updates: at the step boundary the device updates the streamed_updates layers, their "
           "fp32 state up and back down ahead of every load of the step; each one's loads wait for its "
           "last piece down"] if decisions.streamed else []),
        f"loss computed {problem.effective_loss_chunk_tokens} tokens at a time",
    ]
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
        device_state=tuple(sorted(problem.device_state)),
        device_state_sharded=problem.device_state_sharded,
        early_order=decisions.early_order,
        streamed_gradients=decisions.grads_streamed,
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
