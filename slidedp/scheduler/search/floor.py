"""A floor of the step under a device budget: the work every plan must do, shared between the lanes.

cpsat.lower_bound charges the compute of the cheapest activation policies and, where the plan may
stream updates through the device, nothing else: as if memory and PCIe were free. But every plan's
step is at least each lane's busy time (the simulator runs a lane's pieces one after another within
the step, oracles/timeline.py; a CPU lane's round of updates fits in a step's period), and under a
small budget little stays on the device:

- each block keeps its activations (device memory at the turn, after the head's forward, where all
  kept blocks' activations are held: problem/footprint.py), offloads them or its input (D2H and H2D)
  or recomputes (compute);
- each layer's optimizer state is on the device (device memory), or on the host, where its update
  runs on the CPU lane or streams through the device (its pieces up on H2D, down on D2H), and a
  block on the host loads its weights (H2D) and sends its gradient down (D2H) at least once a step.

With fractions x_i,a of each block's policies and y_L,p of each layer's placement:

    step >= C0 + sum x_i,a bwd_i,a                                        (compute)
    step >= sum x_i,a reload_i,a + sum_L y_L,host load_L + y_L,stream up_L    (H2D)
    step >= sum x_i,a offload_i,a + sum_L y_L,host grad_L + y_L,stream down_L (D2H)
    step >= sum_L y_L,cpu U_L                                               (a rank's CPU lane)
    sum x_i,keep m saved_i + sum_L y_L,device state_L <= budget - (the least the turn holds besides)

each term its cheapest option; collectives and the rest only add. The least step of this linear
program (GLOP) bounds every plan that fits, whichever updates it takes. With several ranks the
streamed pieces count for the busiest rank as their average, a rank's share.
"""

from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

from slidedp.scheduler.decisions import KEEP
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.problem.footprint import terms
from slidedp.scheduler.problem.lanes import build_lanes

CPU, STREAM, DEVICE = "cpu", "stream", "device"


def lanes_floor(costs: ProblemCosts, budget_bytes: int) -> int:
    """The floor of the module docstring (ticks); 0 where nothing fits."""
    problem, blocks = costs.problem, sorted(costs.blocks)
    every = [costs, *costs.variants.values()]  # the costs of each choice of streamed tables
    compute0 = min(c.prologue_fwd + c.device_update(problem.device_state) + c.epilogue + c.prologue_bwd
                   for c in every) + sum(costs.blocks[i].fwd for i in blocks)
    room = budget_bytes - min(_turn_bytes_besides(c) for c in every)
    if room < 0:
        return 0
    lp = pywraplp.Solver.CreateSolver("GLOP")
    step = lp.NumVar(0, lp.infinity(), "step")
    compute, h2d, d2h, cpu, memory = [compute0], [], [], [], []
    acts = costs.options.activations
    for i in blocks:
        b = costs.blocks[i]
        x = {a: lp.NumVar(0, 1, f"x[{i},{a}]") for a in acts}
        lp.Add(sum(x.values()) == 1)
        compute += [x[a] * b.bwd[a] for a in acts]
        h2d += [x[a] * b.reload.get(a, 0) for a in acts]
        d2h += [x[a] * b.offload.get(a, 0) for a in acts]
        if KEEP in acts:
            memory.append(x[KEEP] * problem.micro_batches * b.saved_bytes)
    for layer in problem.graph.layers:
        host = [o for o in costs.layer_options[layer.id] if not o.on_device]
        where = {p: lp.NumVar(0, 1, f"y[{layer.id},{p}]") for p in _placements(costs, layer.id, host)}
        lp.Add(sum(where.values()) == 1)
        if DEVICE in where:
            memory.append(where[DEVICE] * costs.device_state_layer_bytes[layer.id])
        if CPU in where:
            cpu.append(where[CPU] * min(o.update_lane_ticks() for o in host))
        if STREAM in where:
            up, down = _streamed_ticks(costs, layer.id)
            h2d.append(where[STREAM] * up)
            d2h.append(where[STREAM] * down)
        if layer.id in costs.blocks and host:  # its weights up and its gradient down, once a step
            on_host = sum(where[p] for p in (CPU, STREAM) if p in where)
            h2d.append(on_host * min(o.load_pieces * min(o.fwd_piece, o.fwd_piece_duplex) for o in host))
            d2h.append(on_host * min(o.grad_pieces * o.grad_piece for o in host))
    for lane in (compute, h2d, d2h, cpu):
        lp.Add(step >= sum(lane))
    lp.Add(sum(memory) <= room)
    lp.Minimize(step)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return 0
    value = step.solution_value()
    return max(0, math.floor(value - 1e-6 * max(1.0, value)))  # under the LP's tolerance: never above it


def _placements(costs: ProblemCosts, layer_id: int, host: list) -> tuple[str, ...]:
    """Where a layer's optimizer state may be and be updated."""
    problem = costs.problem
    if layer_id in problem.device_state or not costs.problem.graph.layers[layer_id].numel:
        return (DEVICE,) if layer_id in problem.device_state else (CPU,)
    out = (CPU,) if host else ()
    if problem.streamed_updates and layer_id in costs.streamed_layers:
        out += (STREAM,)
    if layer_id in problem.device_state_optional:
        out += (DEVICE,)
    return out


def _streamed_ticks(costs: ProblemCosts, layer_id: int) -> tuple[float, float]:
    """(up, down) ticks of a rank's share of the layer's streamed update, the least over chunk counts."""
    W = costs.problem.world_size
    shares = [(sum(u for chunk in chunks for u, _ in chunk) / W, sum(d for chunk in chunks for _, d in chunk) / W)
              for (i, _), chunks in costs.streamed_pieces.items() if i == layer_id]
    return min(u for u, _ in shares), min(d for _, d in shares)


def _turn_bytes_besides(costs: ProblemCosts) -> int:
    """The least device memory at the turn (the head's position) of any decisions, kept activations and
    optimizer state aside: the base terms of the narrowest window, less every block input that may
    leave the device there."""
    N = costs.n_blocks
    turns = [terms(costs, w, build_lanes(N, w, False).compute_keys)[N + 1] for w in costs.windows()]
    return min(t.base_bytes - sum(b for _, b in t.unstashed) for t in turns)
