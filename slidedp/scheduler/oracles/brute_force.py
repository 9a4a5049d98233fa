"""Brute force: every combination of the options, each simulated. For small graphs only; the
tests check that CP-SAT's optimum equals this one's."""

from __future__ import annotations

from itertools import product

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import GROUPS, RESIDENT, STREAMED, Decisions, LayerChoice
from slidedp.scheduler.problem.footprint import evaluate
from slidedp.scheduler.problem.lanes import build_lanes
from slidedp.scheduler.oracles.timeline import simulate


def all_decisions(costs: ProblemCosts):
    """Every Decisions the options allow: windows x orders x routes per group x chunks per layer
    x activation per block x delivery copy per copyable layer x placement of the optimizer state per
    layer where it is a decision (every set of layers on the device) x the tables that stream where
    that is a decision (Problem.vocab_choices: every allowed set) x the gradients kept or, where they
    may, streamed into the update (Decisions.grads_streamed)."""
    W = costs.problem.world_size
    blocks = sorted(costs.blocks)
    # (delivery copy, state on the device, table streamed) per layer, as its options have them
    copy_choices = [sorted({(o.host_copy, o.on_device, o.vocab_streamed) for o in opts}) for opts in costs.layer_options]
    allowed = set(costs.variants) if costs.variants else {costs.problem.vocab_streamed}
    for window in costs.windows():
        for order in costs.options.update_orders:
            for routes in product(costs.routes, repeat=len(GROUPS)):
                route_of = [routes[0]] + [routes[1]] * len(blocks) + [routes[2]]
                for mults in product(costs.options.chunk_multiples, repeat=costs.n_layers):
                    for acts in product(costs.options.activations, repeat=len(blocks)):
                        for copies in product(*copy_choices):
                            streamed = frozenset(i for i in (0, costs.epilogue_id) if copies[i][2])
                            if streamed not in allowed:
                                continue
                            act_of = ([STREAMED if copies[0][2] else RESIDENT] + list(acts)
                                      + [STREAMED if copies[-1][2] else RESIDENT])
                            d = Decisions(window, order, tuple(
                                LayerChoice(mults[i] * W, act_of[i], route_of[i][0], route_of[i][1], *copies[i][:2])
                                for i in range(costs.n_layers)))
                            yield d
                            if costs.may_stream_gradients(d):
                                yield d.with_streamed_gradients(costs.n_layers)


def brute_force(costs: ProblemCosts, budget_bytes: int) -> tuple[int, Decisions] | None:
    """The fastest decisions within the budget (ties: the first enumerated), or None."""
    best = None
    for d in all_decisions(costs):
        keys = build_lanes(costs.n_blocks, d.window, False).compute_keys
        if not costs.fits(d, evaluate(costs, d, keys).peak_bytes, budget_bytes):
            continue
        t = simulate(costs, d).makespan
        if best is None or t < best[0]:
            best = (t, d)
    return best


def brute_force_vocab(problem, options, budget_bytes: int):
    """Brute force over the vocabulary decision too: (ticks, vocab set, Decisions) of the fastest, or None."""
    best = None
    for choice in problem.graph.vocab_sets():
        found = brute_force(ProblemCosts(problem.with_vocab_streamed(choice), options), budget_bytes)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], choice, found[1])
    return best
