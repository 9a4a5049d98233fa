"""A saved plan's decisions simulated again, under any hardware: the cost model's step for a plan
that already ran (or will run elsewhere), without solving anything.

`replay(plan, graph, hardware)` rebuilds the problem the plan fixes (its workload, its streamed
tables, its state kept on the device, the kinds of updates it uses) and the decisions it holds, and
lays them out with the program-order simulator (oracles/timeline.py). Under the hardware the plan was
solved for it gives the plan's own predicted step; under another profile (a `slidedp calibrate`
output, another preset, a cost model changed since) it says what that model predicts for the same
decisions, which is how a benchmark compares today's model with the steps that ran.
"""

from __future__ import annotations

from dataclasses import replace

from slidedp.costmodel.hardware import Hardware
from slidedp.ir.graph import LayerGraph
from slidedp.scheduler.decisions import (
    CPU, FORWARD_ORDER, HEAD_FIRST, ON_LOAD, REPLICATED, STREAMED, Decisions, LayerChoice, Problem, SolverOptions,
)
from slidedp.scheduler.oracles.timeline import Simulation, simulate
from slidedp.scheduler.plan import Plan
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.solve import plan_for

UNBOUNDED_BYTES = 1 << 62  # early updates' spare state: the plan already fits where it was made


def plan_decisions(plan: Plan) -> Decisions:
    """The decisions a plan holds (the solver's form of its schedule)."""
    s = plan.schedule
    last = len(s.decisions) - 1
    on_device = set(s.device_state)
    layers = tuple(LayerChoice(d.chunks, d.activation, d.delivery, d.reduction, d.host_copy, d.layer_id in on_device)
                   for d in s.decisions)
    order = HEAD_FIRST if len(s.update_order) > 1 and s.update_order[1] == last else FORWARD_ORDER
    return Decisions(s.window, order, layers, tuple(s.early_order), tuple(s.streamed_updates),
                     s.streamed_gradients)


def plan_costs(plan: Plan, graph: LayerGraph, hardware: Hardware | None = None) -> ProblemCosts:
    """The costs of the problem a plan fixes, under `hardware` (None: the one it was solved for).
    `graph` must be the plan's model (its fingerprint) at the plan's batch and sequence."""
    if graph.fingerprint() != plan.model_fingerprint:
        raise ValueError(f"the graph (fingerprint {graph.fingerprint()[:12]}) is not the plan's model "
                         f"({plan.model_fingerprint[:12]})")
    if (graph.batch_size, graph.seq_len) != (plan.workload.batch_size, plan.workload.seq_len):
        raise ValueError(f"the graph is traced at batch {graph.batch_size} x {graph.seq_len} tokens, the plan's "
                         f"workload at {plan.workload.batch_size} x {plan.workload.seq_len}")
    s, w = plan.schedule, plan.workload
    hw = Hardware.from_dict(plan.hardware) if hardware is None else hardware
    routes = {(d.delivery, d.reduction) for d in s.decisions}
    options = SolverOptions() if routes == {(REPLICATED, CPU)} else SolverOptions(
        deliveries=tuple(sorted({r[0] for r in routes})), reductions=tuple(sorted({r[1] for r in routes})))
    problem = Problem(
        graph, hw, w.world_size, w.micro_batches, s.loss_chunk_tokens or graph.seq_len * graph.batch_size,
        w.compiled_blocks, hosts=w.hosts, link_bytes_per_s=w.link_bytes_per_s,
        device_state=frozenset(s.device_state), device_state_sharded=s.device_state_sharded,
        early_host_bytes=UNBOUNDED_BYTES if s.early_order else None, streamed_updates=bool(s.streamed_updates),
        grads_streamable=s.streamed_gradients,
        early_in_place=s.early_in_place or s.streamed_gradients,  # both only where nonfinite="stop": in place
        vocab_streamed=frozenset(d.layer_id for d in s.decisions if d.activation == STREAMED),
        copies_on_load=any(d.host_copy == ON_LOAD for d in s.decisions))
    if problem.vocab_streamed:
        problem = _with_vocab_rows(problem, s.vocab_chunk_rows)
    return ProblemCosts(problem, options)


def replay(plan: Plan, graph: LayerGraph, hardware: Hardware | None = None, *, record: bool = False) -> Simulation:
    """The plan's decisions laid out under `hardware` (None: the one it was solved for)."""
    return simulate(plan_costs(plan, graph, hardware), plan_decisions(plan), record=record)


def twin(plan: Plan, graph: LayerGraph, *, streamed_updates, why: str) -> Plan:
    """The plan with only `streamed_updates` (some of its own) updated through the device, its other
    streamed layers updated on the CPU at the step boundary, every other decision its own: laid out and
    explained afresh under the hardware it holds. The solver record credits the streamed updates to `why`,
    an edit and not a search: one decision's A/B twin, to run beside the plan itself. Plans with early
    updates or streamed gradients are refused (their CPU updates of those layers would change kind)."""
    s = plan.schedule
    kept = tuple(i for i in s.streamed_updates if i in set(streamed_updates))
    if set(streamed_updates) - set(kept):
        raise ValueError(f"layers {sorted(set(streamed_updates) - set(kept))} are not among the plan's streamed "
                         f"updates {list(s.streamed_updates)}")
    if s.early_order or s.streamed_gradients:
        raise ValueError("a plan with early updates or streamed gradients has no twin here")
    edited = plan.replace(streamed_updates=kept)
    costs = plan_costs(edited, graph)
    searches = {**plan.solver.get("searches", {}), "streamed updates": why}
    solver = {**plan.solver, "chosen_by": f"{plan.solver.get('chosen_by', 'unknown')}, streamed updates edited",
              "searches": searches}
    out = plan_for(costs, plan_decisions(edited), budget_bytes=plan.budget_bytes, precision=plan.workload.precision,
                   version=plan.slidedp_version, solver=solver)
    if out.peak_device_bytes > plan.budget_bytes:
        raise ValueError(f"the twin needs {out.peak_device_bytes} B of device memory, over the plan's budget")
    return out


def _with_vocab_rows(problem: Problem, rows: int) -> Problem:
    """The problem whose streamed tables move `rows` rows a chunk, as the plan's did."""
    fixed = replace(problem, vocab_chunk_numel=rows * problem.graph.hidden_size)
    if fixed.vocab_chunk_rows != rows:
        raise ValueError(f"the plan streams {rows} rows a chunk, which this model's tables cannot")
    return fixed
