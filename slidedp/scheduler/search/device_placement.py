"""Seeds for the placement of the optimizer state, which the CP-SAT model decides (cpsat.py).

A layer whose fp32 master and moments live on the device takes them off PCIe and its update off the
CPU, at the price of their device memory for good (12 B per parameter and its gradient), which the
other decisions (window, kept activations) no longer have. The model weighs that per layer; on large
models its search has little time, so it starts from a good placement: with the state of the first
k layers that may go there (blocks in forward order, then the epilogue) on the device, with and
without the prologue, the faster of the greedy baseline (baselines.greedy: activations kept where
device memory allows) and the least-memory decisions (cpsat.minimum_peak with that placement:
activations offloaded where host memory allows) in each window that fits, each judged by the
simulator's closed form (local_search.score). k is swept as the step is about unimodal in it: from
the fewest with which the host fits to the most whose state fits next to the least-memory schedule,
at 0, 1/4, 1/2, 3/4 and all of that range, then the midpoints around the best until neighbours are
tried (ties: the fewest layers, without the prologue).
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.scheduler.decisions import Decisions
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.search import baselines, cpsat, local_search
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.search.found import Found


def layer_order(costs: ProblemCosts) -> list[int]:
    """The layers but the prologue whose placement is a decision, in forward order (the epilogue last)."""
    prologue = costs.problem.graph.prologue.id
    return [i for i in sorted(costs.problem.device_state_optional) if i != prologue]


def search(costs: ProblemCosts, budget_bytes: int, least: Decisions, least_peak_bytes: int) -> Found | None:
    """The fastest schedule of the sweep, a prefix of `layer_order` (and maybe the prologue) on the
    device, that fits both budgets (None: the placement is no decision, or nothing fits); `least`:
    decisions of the least peak, `least_peak_bytes`, next to whose other buffers the state must fit."""
    problem = costs.problem
    if not problem.device_state_optional:
        return None
    order, prologue = layer_order(costs), problem.graph.prologue.id
    families = [False] + ([True] if prologue in problem.device_state_optional else [])
    spare = budget_bytes - (least_peak_bytes - costs.device_state_bytes(least.device_state))
    tried: dict[tuple[bool, int], tuple[float, object]] = {}

    def on_device(family: bool, k: int) -> frozenset:
        return problem.device_state | frozenset(order[:k]) | ({prologue} if family else frozenset())

    def at(family: bool, k: int) -> float:
        if (family, k) not in tried:
            placed = on_device(family, k)
            least = cpsat.minimum_peak(costs, costs.windows()[0], on_device=placed)
            greedy = baselines.greedy(costs, budget_bytes, on_device=placed)
            found = [greedy] if greedy is not None else []
            if least is not None and least[0] <= budget_bytes:
                found += [replace(least[2], window=w) for w in costs.windows() if w >= least[2].window]
            tried[(family, k)] = min(((local_search.score(costs, d, budget_bytes), i, d) for i, d in enumerate(found)),
                                     default=(float("inf"), 0, None))[::2]
        return tried[(family, k)][0]

    host = problem.host_budget_bytes
    for family in families:
        if costs.device_state_bytes(on_device(family, 0)) > spare:
            continue
        k_max = 0
        while k_max < len(order) and costs.device_state_bytes(on_device(family, k_max + 1)) <= spare:
            k_max += 1
        k_min = next((k for k in range(k_max + 1)
                      if host is None or costs.host_fixed.bytes(on_device(family, k)) <= host), None)
        if k_min is None:
            continue
        for f in (0.0, 0.25, 0.5, 0.75, 1.0):
            at(family, k_min + round((k_max - k_min) * f))
        while True:
            ks = sorted(k for p, k in tried if p == family)
            best = min(ks, key=lambda k: (at(family, k), k))
            i = ks.index(best)
            todo = [k for k in ((ks[j] + best) // 2 for j in (i - 1, i + 1) if 0 <= j < len(ks))
                    if (family, k) not in tried]
            if not todo:
                break
            for k in todo:
                at(family, k)
    fitting = [(t, k, family) for (family, k), (t, d) in tried.items() if d is not None and t < float("inf")]
    if not fitting:
        return None
    _, k, family = min(fitting)
    d = tried[(family, k)][1]
    return Found("device-state prefix", d, simulate(costs, d, all_ranks=False))
