"""Rows per micro-batch: a sweep around the solver, over the ways to group a step's rows.

A rank's rows of a step (batch_size x micro_batches) may pass through the blocks one row at a time or
several at once: the same tokens and the same summed gradient (to rounding), but not the same step.
More rows per micro-batch mean fewer, larger kernels: the host issues each block once a micro-batch,
so a narrow model whose compiled blocks take the host about as long to issue as the device to run
(`Hardware.host_compiled_fwd_s` / `_bwd_s`) gains most (measured on an H100, Qwen3-1.7B at 65,536
tokens within 12 GiB: 2.60 s a step with 16 one-row micro-batches, 2.13 s with 8 of two;
benchmarks/LOG.md). They also mean more activation memory per micro-batch, which a small budget may
not hold. Each grouping is a different layer graph (the activations of a micro-batch), so each is
traced and solved in full (CP-SAT and the searches around it) and the fastest predicted is kept; the
plan says so (`Explanation.solver["searches"]`, `["rows_tried"]`, and an Alternative).

`group_rows="auto"` (the default) sweeps only where the cost model finds the asked grouping's blocks
host-bound (`blocks_host_bound`): elsewhere its compute rate does not depend on rows, so more rows can
only cost activation memory, and the one solve of the asked grouping is kept.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from slidedp.costmodel import ops
from slidedp.costmodel.hardware import Hardware
from slidedp.errors import InfeasibleBudgetError
from slidedp.ir.graph import LayerGraph
from slidedp.scheduler.plan import Alternative, Plan

log = logging.getLogger("slidedp")

MAX_ROWS = 8  # rows per micro-batch tried at most (8 x 4,096 tokens: the blocks' kernels are large by then)
SEARCH = "rows per micro-batch"
AUTO = "auto"  # group_rows: sweep where the blocks are host-bound (blocks_host_bound)


def check_group_rows(value) -> bool | str:
    """`value` as group_rows takes it: True (sweep), False (keep the asked grouping) or AUTO."""
    if isinstance(value, bool) or value == AUTO:
        return value
    raise TypeError(f"group_rows must be True, False or {AUTO!r}, got {value!r}")


def blocks_host_bound(graph: LayerGraph, hardware: Hardware, compiled: bool) -> bool:
    """Whether the host takes longer to issue a block's forward and backward of one micro-batch of
    `graph` than the device takes to run them (costmodel/ops.py), the case more rows can gain in."""
    if not graph.blocks:
        return False
    host_s, device_s = ops.block_host_and_device_s(graph.blocks[0].costs, hardware, compiled=compiled)
    return host_s > device_s


def groupings(rows_per_step: int, max_rows: int = MAX_ROWS) -> tuple[int, ...]:
    """The rows per micro-batch that divide a rank's `rows_per_step`, at most `max_rows`, fewest first."""
    if rows_per_step < 1:
        raise ValueError(f"rows_per_step must be >= 1, got {rows_per_step}")
    return tuple(r for r in range(1, min(rows_per_step, max_rows) + 1) if rows_per_step % r == 0)


def fastest_grouping(rows_per_step: int, asked_rows: int, solve: Callable[[int], Plan],
                     max_rows: int = MAX_ROWS) -> Plan:
    """The plan of the fastest predicted grouping of a rank's `rows_per_step` rows: `solve(rows)` plans
    micro-batches of `rows` rows (rows_per_step // rows of them). A tie keeps `asked_rows` (the
    grouping asked for), then the fewer rows. Groupings whose plan does not fit are passed over; where
    none fits, the asked grouping's InfeasibleBudgetError is raised."""
    options = groupings(rows_per_step, max_rows)
    if asked_rows not in options:
        options = (asked_rows, *options)
    plans: dict[int, Plan] = {}
    refused: InfeasibleBudgetError | None = None
    start = time.perf_counter()
    for i, rows in enumerate(sorted(options, key=lambda r: r != asked_rows)):  # the asked one first
        log.info("slidedp: planning micro-batches of %d row(s), %d of %d groupings", rows, i + 1, len(options))
        try:
            plans[rows] = solve(rows)
        except InfeasibleBudgetError as exc:
            if rows == asked_rows:
                refused = exc
    if not plans:
        assert refused is not None
        raise refused
    tried = {rows: plan.predicted_step_time_s for rows, plan in plans.items()}
    best = min(tried, key=lambda r: (tried[r], r != asked_rows, r))
    return _annotated(plans[best], tried, best, sorted(set(options) - set(plans)), time.perf_counter() - start)


def _annotated(plan: Plan, tried: dict[int, float], chosen: int, unfit: list[int], wall_s: float) -> Plan:
    """`plan` with the sweep named in its solver record (and the seconds all its solves took), its
    searches and its alternatives."""
    solver = dict(plan.solver)
    solver["chosen_by"] = f"{solver.get('chosen_by', 'unknown')} + {SEARCH} swept"
    solver["rows_tried"] = {str(rows): step_s for rows, step_s in sorted(tried.items())}
    solver["rows_sweep_wall_s"] = wall_s
    if unfit:
        solver["rows_unfit"] = unfit
    if solver.get("gap_explained"):  # the bound is of the chosen grouping's problem
        solver["gap_explained"] += f" (among plans of {chosen}-row micro-batches; the groupings swept)"
    solver["searches"] = {**solver.get("searches", {}), SEARCH: (
        "sweep: each grouping of the step's rows traced and solved, the fastest predicted kept "
        "(search/micro_rows.py)")}
    alternatives = plan.alternatives
    others = [r for r in tried if r != chosen]
    if others:
        other = min(others, key=lambda r: (tried[r], r))
        reason = (f"{chosen} row(s): {tried[chosen] * 1e3:.1f} ms; {other} row(s): {tried[other] * 1e3:.1f} ms. "
                  "More rows per micro-batch: fewer, larger kernels for the host to issue, more activation "
                  "memory per micro-batch")
        alternatives += (Alternative(SEARCH, f"{chosen} row(s)", f"{other} row(s)", tried[chosen], tried[other], 0,
                                     reason),)
    return plan.replace(solver=solver, alternatives=alternatives)
