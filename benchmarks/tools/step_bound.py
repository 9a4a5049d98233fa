"""A saved plan's simulated step taken apart, no GPU: each lane's busy time, the critical path, and the
step if some layers' updates cost nothing.

    python benchmarks/tools/step_bound.py PLAN.json --shape 4b --free prologue --free-last-blocks 6 12

The plan is replayed under the hardware it holds (scheduler/replay.py). `--free prologue` and
`--free-last-blocks K` (each K a what-if of its own, with the prologue if also asked) put those layers'
optimizer state on the device at no cost: no device memory counted, no copies, no CPU work. The CPU's
order of early updates is chosen again for the layers left (search/early_order.py; streamed gradients keep
the landing order). What comes out bounds
what taking those updates off the host's critical path, by any means, could give the plan's decisions.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from itertools import groupby
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.model import SHAPES, plan_graph_of  # noqa: E402

from slidedp.scheduler.decisions import KEPT, Decisions  # noqa: E402
from slidedp.scheduler.oracles.timeline import Simulation, simulate  # noqa: E402
from slidedp.scheduler.plan import Plan  # noqa: E402
from slidedp.scheduler.problem.costs import ProblemCosts  # noqa: E402
from slidedp.scheduler.replay import plan_costs, plan_decisions  # noqa: E402
from slidedp.scheduler.search.early_order import best_early  # noqa: E402


def lanes_ms(sim: Simulation) -> dict[str, float]:
    return {lane: round(busy * sim.tick_s * 1e3, 1) for lane, busy in sim.lane_busy.items()}


def critical_path(sim: Simulation) -> list[dict]:
    """The chain that sets the step, runs of the same lane and kind of op merged: lane, what ("fwd",
    "state up", ...), the first and last layer, how many pieces, start and end [ms]."""
    chain = [sim.events[i] for i in sim.critical_path]
    out = []
    for (lane, what), run in groupby(chain, key=lambda e: (e.lane, e.name.split(" L")[0])):
        run = list(run)
        out.append({"lane": lane, "what": what, "layers": [run[0].layer, run[-1].layer], "pieces": len(run),
                    "start_ms": round(run[0].start * sim.tick_s * 1e3, 1),
                    "end_ms": round(run[-1].end * sim.tick_s * 1e3, 1)})
    return out


def freed(costs: ProblemCosts, d: Decisions, layer_ids) -> tuple[ProblemCosts, Decisions]:
    """The problem and decisions with `layer_ids`' optimizer state on the device (a streamed table's
    prologue or epilogue loaded whole instead), out of the CPU's order and the streamed updates."""
    ids = frozenset(layer_ids)
    p = costs.problem
    p = replace(p, device_state=p.device_state | ids, vocab_streamed=p.vocab_streamed - ids)
    out = ProblemCosts(p, costs.options)
    # a layer whose state is on the device makes its copy there (KEPT), whatever its host copy was
    layers = tuple(replace(c, on_device=True, host_copy=KEPT,
                           activation=out.edge_activation(i) if i in costs.problem.vocab_streamed else c.activation)
                   if i in ids else c for i, c in enumerate(d.layers))
    e = replace(d, layers=layers, early_order=tuple(i for i in d.early_order if i not in ids),
                streamed=tuple(i for i in d.streamed if i not in ids))
    return out, e


def what_if(costs: ProblemCosts, d: Decisions, layer_ids) -> dict:
    c, e = freed(costs, d, layer_ids)
    chosen = best_early(c, e) if e.early_order and not e.grads_streamed else None  # streamed: in landing order
    e = chosen[0] if chosen is not None else e
    sim = simulate(c, e, record=True)
    return {"free_layers": sorted(layer_ids), "step_s": round(sim.step_s, 4), "lanes_ms": lanes_ms(sim),
            "critical_path": critical_path(sim)}


def bound(plan: Plan, shape: str, *, prologue: bool = False, last_blocks=()) -> dict:
    graph = plan_graph_of(plan, shape)
    costs, d = plan_costs(plan, graph), plan_decisions(plan)
    sim = simulate(costs, d, record=True)
    n = costs.n_layers
    head = [0] if prologue else []
    cases = [head] if prologue else []
    cases += [head + list(range(n - 1 - k, n - 1)) for k in last_blocks]
    return {"step_s": round(sim.step_s, 4), "lanes_ms": lanes_ms(sim), "critical_path": critical_path(sim),
            "what_if": [what_if(costs, d, ids) for ids in cases]}


def render(out: dict) -> str:
    lines = []

    def one(title: str, r: dict) -> None:
        lanes = ", ".join(f"{k} {v:.0f}" for k, v in r["lanes_ms"].items())
        lines.append(f"{title}: step {r['step_s'] * 1e3:.1f} ms (busy ms: {lanes})")
        first = r["critical_path"][0]["start_ms"] if r["critical_path"] else 0.0
        if first > 0:  # only early updates release a piece later than the step's start
            lines.append(f"  {0.0:9.1f} - {first:9.1f} ms  the path's first piece waits for the CPU's update of its "
                         "layer, carried over from the step before")
        for p in r["critical_path"]:
            a, b = p["layers"]
            lines.append(f"  {p['start_ms']:9.1f} - {p['end_ms']:9.1f} ms  {p['lane']:10s} {p['what']} "
                         f"L{a}{'' if a == b else f'..L{b}'} ({p['pieces']} pieces)")

    one("as planned", out)
    for r in out["what_if"]:
        one(f"updates of layers {r['free_layers']} free", r)
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path, help="a plan JSON (e.g. benchmarks/predict_vs_measured/registered/*.json)")
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the model shape the plan was made for")
    ap.add_argument("--free", choices=["prologue"], action="append", default=[],
                    help="the prologue's update at no cost, in every what-if")
    ap.add_argument("--free-last-blocks", type=int, nargs="*", default=[], metavar="K",
                    help="a what-if for each K: the last K blocks' updates at no cost")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    plan = Plan.from_dict(json.loads(args.plan.read_text()))
    out = bound(plan, args.shape, prologue="prologue" in args.free, last_blocks=args.free_last_blocks)
    print(json.dumps(out, indent=1) if args.json else render(out))
    return out


if __name__ == "__main__":
    main()
