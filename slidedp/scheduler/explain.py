"""Why a plan looks the way it does: per-group predictions, and each decision against its
runner-up (the same plan with that decision changed, simulated). Computed when the plan is made
(the Plan carries no graph), printed by `Plan.summary()`."""

from __future__ import annotations

from dataclasses import replace

from slidedp.budget import format_bytes
from slidedp.costmodel import ops
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import (
    CPU, GPU, HEAD_FIRST, KEEP, OFFLOAD, OFFLOADED, ON_LOAD, RECOMPUTE, RECOMPUTE_OFFLOAD, REPLICATED, SHARDED,
    Decisions,
)
from slidedp.scheduler.plan import Alternative, GroupPrediction
from slidedp.scheduler.problem.lanes import COLLECTIVE, COMPUTE, CPU_UPDATE, D2H, H2D, build_lanes
from slidedp.scheduler.oracles.timeline import Simulation, simulate
from slidedp.scheduler.search.local_search import device_state_moves

LANES = (COMPUTE, H2D, D2H, COLLECTIVE, CPU_UPDATE)


def layer_groups(costs: ProblemCosts, d: Decisions) -> list[list[int]]:
    """Consecutive blocks with identical decisions form a group; prologue and epilogue alone."""
    groups: list[list[int]] = []
    for i, c in enumerate(d.layers):
        if groups and 0 < i < costs.epilogue_id and 0 < groups[-1][0] < costs.epilogue_id \
                and d.layers[groups[-1][0]] == c:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _label(costs: ProblemCosts, ids: list[int]) -> str:
    layers = costs.problem.graph.layers
    if len(ids) == 1:
        return layers[ids[0]].name
    return f"{layers[ids[0]].name} .. {layers[ids[-1]].name.rsplit('.', 1)[-1]}"


def group_predictions(costs: ProblemCosts, d: Decisions, sim: Simulation) -> tuple[GroupPrediction, ...]:
    """Bytes moved, busy time per lane, exposed compute wait and bottleneck of each layer group."""
    g, W, m, tick = costs.problem.graph, costs.problem.world_size, costs.problem.micro_batches, sim.tick_s
    busy_by_layer: dict[int, dict[str, int]] = {}
    for op in sim.ops.values():
        if op.lane != CPU_UPDATE:
            busy_by_layer.setdefault(op.layer, dict.fromkeys(LANES, 0))[op.lane] += op.busy
    exposed: dict[int, int] = {}
    compute = [op for op in sim.ops.values() if op.lane == COMPUTE]
    compute.sort(key=lambda op: op.start)
    previous_end = 0
    for op in compute:
        exposed[op.layer] = exposed.get(op.layer, 0) + max(0, op.start - previous_end)
        previous_end = op.end
    program = build_lanes(costs.n_blocks, d.window, W > 1, costs.head_reload)
    reloaded = {op.layer for op in program.lanes[H2D] if op.kind == "load" and op.phase == "bwd"}
    out = []
    for ids in layer_groups(costs, d):
        h2d = d2h = coll = dram = 0
        busy = dict.fromkeys(LANES, 0)
        for i in ids:
            c = d.layers[i]
            o = costs.option_of(i, c)
            layer_bytes = costs.moved_numel(i) * costs.elem
            loads = 1 + (i in reloaded)
            if c.on_device:  # nothing over PCIe; collectives between the devices
                numel = g.layers[i].numel
                if costs.problem.device_state_sharded:  # weights all-gathered, gradient reduce-scattered
                    coll += (loads * layer_bytes + 4 * numel) * (W - 1) / W
                else:  # gradient all-reduced
                    coll += 2 * 4 * numel * (W - 1) / W
                for lane, t in busy_by_layer.get(i, {}).items():
                    busy[lane] += t
                continue
            load_bytes = costs.load_bytes(i, c.host_copy)
            per_rank = load_bytes if c.delivery == REPLICATED else load_bytes / W
            h2d += loads * per_rank
            d2h += layer_bytes if c.reduction == CPU else layer_bytes / W
            if c.delivery == SHARDED:
                coll += loads * layer_bytes * (W - 1) / W
            if c.reduction == GPU:
                coll += layer_bytes * (W - 1) / W
            dram += loads * ops.delivery_dram_bytes(load_bytes, W, c.delivery)
            dram += ops.reduction_dram_bytes(costs.moved_numel(i), costs.elem, W, c.reduction)
            if c.activation in OFFLOADED:
                saved = m * costs.blocks[i].host_bytes[c.activation]
                h2d += saved
                d2h += saved
                dram += 2 * W * saved
            for lane, t in busy_by_layer.get(i, {}).items():
                busy[lane] += t
            busy[CPU_UPDATE] += o.update_lane_ticks()
        bottleneck = max(LANES, key=lambda lane: busy[lane])
        out.append(GroupPrediction(
            label=_label(costs, ids), layer_ids=tuple(ids), h2d_bytes=int(h2d), d2h_bytes=int(d2h),
            collective_bytes=int(coll), host_dram_bytes=int(dram),
            compute_s=busy[COMPUTE] * tick, h2d_s=busy[H2D] * tick, d2h_s=busy[D2H] * tick,
            collective_s=busy[COLLECTIVE] * tick, cpu_update_s=busy[CPU_UPDATE] * tick,
            exposed_s=sum(exposed.get(i, 0) for i in ids) * tick, bottleneck=bottleneck))
    return tuple(out)


def _try(costs: ProblemCosts, d: Decisions, budget_bytes: int):
    """(step_s or None if it does not fit, peak bytes) of some decisions, simulated as the plan is
    (the same oracle, with its streamed updates, early updates and device-resident state), so that
    a runner-up differs from the plan only in the decision changed. None when the simulator refuses
    the decisions (a combination the plan's other decisions rule out)."""
    try:
        sim = simulate(costs, d, all_ranks=False)
    except (ValueError, KeyError):
        return None
    peak = sim.peak_bytes
    if not costs.fits(d, peak, budget_bytes):
        return None, peak
    return sim.step_s, peak


def _runner_up(costs, budget_bytes, candidates):
    """The fastest candidate that fits, else the one needing the least memory."""
    tried = [(name, d, *r) for name, d in candidates if (r := _try(costs, d, budget_bytes)) is not None]
    if not tried:
        return None
    fitting = [t for t in tried if t[2] is not None]
    if fitting:
        return min(fitting, key=lambda t: t[2])
    return min(tried, key=lambda t: t[3])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _compare(chosen_s: float, other_s: float | None, peak: int, budget: int) -> str:
    if other_s is None and peak <= budget:
        return "does not fit the host budget"
    if other_s is None:
        return f"does not fit ({format_bytes(peak)} > budget {format_bytes(budget)})"
    delta = other_s - chosen_s
    sign = "+" if delta >= 0 else "-"
    return f"{_ms(other_s)} ({sign}{_ms(abs(delta))})"


def alternatives(costs: ProblemCosts, d: Decisions, sim: Simulation, budget_bytes: int) -> tuple[Alternative, ...]:
    """Each decision family against its best alternative value, every other decision unchanged."""
    out: list[Alternative] = []
    hw, W, m = costs.problem.hardware, costs.problem.world_size, costs.problem.micro_batches
    step = sim.step_s
    blocks = sorted(costs.blocks)
    first = d.layers[blocks[0]]

    def add(decision, chosen, found, why):
        if found is None:
            return
        name, _, other_s, peak = found
        text = f"{chosen}: {_ms(step)}; {name}: {_compare(step, other_s, peak, budget_bytes)}. {why}"
        out.append(Alternative(decision, chosen, name, step, other_s, int(peak), text))

    # Window.
    others = [(f"window {w}", replace(d, window=w)) for w in costs.windows() if w != d.window]
    slot = format_bytes(costs.weight_slots_bytes(1))
    add("window", f"window {d.window}", _runner_up(costs, budget_bytes, others),
        f"Each slot holds the largest block ({slot}); more slots prefetch further ahead and reload fewer "
        f"blocks at the turn.")

    # Activation policy, per policy in use among the blocks.
    for policy in sorted({d.layers[i].activation for i in blocks}):
        ids = [i for i in blocks if d.layers[i].activation == policy]
        cands = [(f"{other} for them", d.replace_layers(ids, activation=other))
                 for other in costs.options.activations if other != policy]
        b = costs.blocks[ids[0]]
        why = (f"Recomputing costs {_ms((b.bwd[RECOMPUTE] - b.bwd[KEEP]) * sim.tick_s)} of compute per block; "
               f"keeping holds {format_bytes(m * b.saved_bytes)} per block from its forward to its backward; "
               f"offloading moves that over PCIe twice ({_ms(b.offload[OFFLOAD] * sim.tick_s)} down, "
               f"{_ms(b.reload[OFFLOAD] * sim.tick_s)} up).")
        if RECOMPUTE_OFFLOAD in costs.options.activations:
            why += (f" Recompute with its input offloaded takes the block's input "
                    f"({format_bytes(m * b.host_bytes[RECOMPUTE_OFFLOAD])}) off the device between its forward "
                    f"and its backward ({_ms(b.offload[RECOMPUTE_OFFLOAD] * sim.tick_s)} down, "
                    f"{_ms(b.reload[RECOMPUTE_OFFLOAD] * sim.tick_s)} up) and recomputes like recompute.")
        add(f"activation of {len(ids)} block(s)", f"{policy} for {_span(costs, ids)}",
            _runner_up(costs, budget_bytes, cands), why)

    # Chunks of the blocks.
    mult = first.chunks // W
    options = costs.options.chunk_multiples
    cands = [(f"{k * W} chunks", d.replace_layers(blocks, chunks=k * W)) for k in options if k != mult]
    o = costs.option_of(blocks[0], first)
    eff = ops.transfer_efficiency(o.piece_bytes, hw.transfer_efficiency)
    add("chunks per block", f"{first.chunks} chunks", _runner_up(costs, budget_bytes, cands),
        f"A chunk of {format_bytes(o.piece_bytes)} copies at {eff:.0%} of the link's rate; smaller chunks "
        f"let loads start as soon as part of a layer is updated, at a lower copy efficiency.")

    # Update order.
    other_orders = [o for o in costs.options.update_orders if o != d.update_order]
    E = costs.epilogue_id
    head = costs.option_of(E, d.layers[E])
    head_update = _ms(head.update_lane_ticks() * sim.tick_s)
    head_load = _ms(head.load_pieces * head.fwd_piece * sim.tick_s)
    if d.update_order == HEAD_FIRST:
        why = (f"Updating the head second ({head_update} of CPU) and loading it early ({head_load}) keeps both off "
               f"the end of the forward, at the cost of block 1 starting {head_update} later.")
    else:
        why = (f"Updating the head last lets block 1 start {head_update} sooner; its update and load "
               f"({head_load}) then come at the end of the forward.")
    add("update order", d.update_order,
        _runner_up(costs, budget_bytes, [(o, replace(d, update_order=o)) for o in other_orders]), why)

    # Routes of the blocks (W > 1; with several hosts they are fixed: the plan's notes say why).
    if W > 1 and costs.problem.hosts == 1:
        layer_bytes = costs.problem.graph.layers[blocks[0]].numel * costs.elem
        if hw.gpu_p2p_bytes_per_s <= 0:
            bounce = ops.all_gather_time_s(layer_bytes, W, hw)
            copy = ops.transfer_time_s(layer_bytes, ops.h2d_bytes_per_s(hw, W, duplex=False),
                                       hw.transfer_efficiency)
            out.append(Alternative(
                "delivery and reduction", "replicated, cpu", "sharded / gpu", step, None, 0,
                f"no GPU peer-to-peer on {hw.name}: an all-gather of a block would bounce through the host "
                f"({_ms(bounce)} after its 1/{W} copy) against {_ms(copy)} to copy it whole, so sharded delivery "
                f"and GPU reduction are never faster and are not considered."))
        else:
            deliveries = [x for x in costs.options.deliveries if x != first.delivery]
            cands = [(f"{x} delivery", d.replace_layers(blocks, delivery=x)) for x in deliveries
                     if (x, first.reduction) in costs.routes]
            add("delivery of the blocks", f"{first.delivery} delivery", _runner_up(costs, budget_bytes, cands),
                f"Replicated: every rank copies the whole block, host DRAM read {W}x "
                f"({format_bytes(W * layer_bytes)} per block); sharded: each copies 1/{W} and the GPUs all-gather "
                f"({_ms(ops.all_gather_time_s(layer_bytes, W, hw))} at {hw.gpu_p2p_bytes_per_s / 1e9:.0f} GB/s).")
            reductions = [x for x in costs.options.reductions if x != first.reduction]
            cands = [(f"{x} reduction", d.replace_layers(blocks, reduction=x)) for x in reductions
                     if (first.delivery, x) in costs.routes]
            numel = costs.problem.graph.layers[blocks[0]].numel
            add("reduction of the blocks", f"{first.reduction} reduction", _runner_up(costs, budget_bytes, cands),
                f"CPU: {W} gradient copies land per block and the CPU sums them "
                f"({_ms(ops.cpu_reduce_time_s(numel, costs.elem, W, hw, lanes=W))} per block per rank lane); "
                f"GPU: reduce-scatter ({_ms(ops.reduce_scatter_time_s(layer_bytes, W, hw))}), then 1/{W} goes down.")

    # Optimizer state on the device, where its placement is a decision: one layer more or fewer there.
    if costs.problem.device_state_optional:
        g = costs.problem.graph
        cands = [(device_state_label(g, e.device_state), e) for e in device_state_moves(costs, d)]
        add("optimizer state on the device", device_state_label(g, d.device_state),
            _runner_up(costs, budget_bytes, cands),
            "Each layer kept there takes its state's device memory for good "
            f"({format_bytes(min(costs.device_state_layer_bytes[i] for i in range(1, costs.epilogue_id)))} per "
            "rank for the smallest block) and takes its copies and its update off PCIe and the CPU; the "
            "device's updates run beside the next forward, which waits for each layer's; the prologue is "
            "the first layer the next step needs.")

    # Delivery copies, where they are a decision (a host budget that may bind).
    copyable = [i for i in sorted(costs.copyable) if not d.layers[i].on_device]
    if copyable:
        made = [i for i in copyable if d.layers[i].host_copy == ON_LOAD]
        chosen = f"{len(made)} of {len(copyable)} made on load"
        cands = [(f"all {x}", d.replace_layers(copyable, host_copy=x)) for x in costs.options.host_copies
                 if any(d.layers[i].host_copy != x for i in copyable)]
        add("delivery copies", chosen, _runner_up(costs, budget_bytes, cands),
            f"A kept copy takes {costs.elem} B per parameter of host RAM; made on load, the layer's loads read "
            "the fp32 master (4 B per parameter over PCIe, twice the bytes) and the device casts each chunk.")

    # The gradients, where they may stream into the update (a Boolean of the CP-SAT model).
    if d.grads_streamed:
        add("gradients", "streamed into the update", _runner_up(costs, budget_bytes, [
            ("kept to the step boundary", replace(d, grads_streamed=False, early_order=()))]), _GRADIENTS_WHY)
    elif costs.may_stream_gradients(d):
        add("gradients", "kept to the step boundary" if not d.early_order else "kept, early updates",
            _runner_up(costs, budget_bytes, [("streamed into the update", d.with_streamed_gradients(costs.n_layers))]),
            _GRADIENTS_WHY)
    return tuple(out)


_GRADIENTS_WHY = ("Streamed, each host layer's gradient updates it in place as it lands, during the backward (at the "
                  "CPU's rate beside the copies both ways), so the host keeps no gradient (4 B per parameter) and "
                  "no spare; kept, the CPU updates after the step boundary, and the next forward waits for the first "
                  "layers' updates.")


def device_state_label(graph, on_device) -> str:
    """"no layer", or e.g. "the prologue + 12 blocks + the epilogue": the layers `on_device`."""
    n_blocks = sum(1 for i in on_device if i not in (graph.prologue.id, graph.epilogue.id))
    parts = (["the prologue"] if graph.prologue.id in on_device else []) + (
        [f"{n_blocks} block{'s' if n_blocks != 1 else ''}"] if n_blocks else []) + (
        ["the epilogue"] if graph.epilogue.id in on_device else [])
    return " + ".join(parts) or "no layer"


def _span(costs: ProblemCosts, ids: list[int]) -> str:
    if len(ids) == 1:
        return f"block {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"blocks {ids[0]}-{ids[-1]}"
    return f"{len(ids)} blocks"

