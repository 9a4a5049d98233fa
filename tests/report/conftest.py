"""Plans with a synthetic but realistic predicted timeline, for the report tests.

The scheduler that fills `Plan.timeline` is written elsewhere; these plans imitate what it will
produce: per rank, each layer's chunks are copied in (H2D, then an all-gather of the shards when
several ranks share the delivery) and the forward runs; backward goes in reverse, with a reload
and a recompute where the plan says so, the gradient chunks are copied out (D2H) and the CPU
updates them. Each op waits for its inputs and for its lane, so lanes overlap as in a pipeline.
"""

from collections import defaultdict

import pytest

from slidedp.scheduler.plan import (
    SCHEMA_VERSION, Explanation, LayerDecision, MemoryPoint, Plan, Schedule, TimelineEvent, Workload,
)
from slidedp.scheduler.problem.lanes import window_loads

MiB = 2**20


def synthetic_decisions(blocks: int, chunks: int) -> tuple[LayerDecision, ...]:
    layers = [LayerDecision(0, "model.embed_tokens", "prologue", 49_152 * 576, 1, "resident")]
    for b in range(blocks):
        activation = "keep" if b >= blocks - 2 else "recompute"
        layers.append(LayerDecision(b + 1, f"model.layers.{b}", "block", 3_540_096, chunks, activation,
                                    delivery="sharded", reduction="cpu"))
    layers.append(LayerDecision(blocks + 1, "model.norm+lm_head", "epilogue", 576, 1, "resident"))
    return tuple(layers)


def synthetic_timeline(decisions, world_size: int, window: int = 2):
    """Events and memory points of one step: a list scheduler over per-rank lanes (seconds, bytes)."""
    events: list[TimelineEvent] = []
    deltas: list[tuple[float, int, int]] = []  # (t, rank or -1 for pinned host, bytes)
    blocks = [d for d in decisions if d.kind == "block"]
    for rank in range(world_size):
        skew = 1.0 + 0.04 * rank
        free: dict[str, float] = defaultdict(float)

        def op(lane, name, layer, chunk, duration_s, after=0.0):
            start = max(free[lane], after)
            end = start + duration_s * skew
            free[lane] = end
            events.append(TimelineEvent(rank, lane, name, layer, chunk, start, end))
            return start, end

        weight_bytes = {d.layer_id: d.numel * 2 for d in decisions}
        fwd_end: dict[int, float] = {}
        t_prev = 0.0
        for i, d in enumerate(decisions):
            slot_free = fwd_end.get(blocks[i - 1 - window].layer_id, 0.0) if d.kind == "block" and i - 1 - window >= 0 else 0.0
            ready = 0.0
            for c in range(d.chunks):
                s, e = op("h2d", f"h2d L{d.layer_id} c{c}", d.layer_id, c, 1.4e-3 / d.chunks, slot_free)
                deltas.append((s, rank, weight_bytes[d.layer_id] // d.chunks))
                if world_size > 1 and d.kind == "block":
                    _, e = op("collective", f"all-gather L{d.layer_id} c{c}", d.layer_id, c, 0.35e-3 / d.chunks, e)
                ready = max(ready, e)
            _, t_prev = op("compute", f"fwd L{d.layer_id}", d.layer_id, 0, 2.0e-3 if d.kind == "block" else 0.8e-3,
                           max(ready, t_prev))
            fwd_end[d.layer_id] = t_prev
            deltas.append((t_prev, rank, 24 * MiB))  # the boundary activation kept for backward
            if d.kind == "block" and i - 1 < len(blocks) - window:
                deltas.append((t_prev, rank, -weight_bytes[d.layer_id]))  # slot reused; reloaded for backward
        bwd_end: dict[int, float] = {}
        for j, d in enumerate(reversed(decisions)):
            resident_at_turn = d.kind == "block" and d.layer_id > len(blocks) - window
            ready = t_prev
            if d.kind == "block" and not resident_at_turn:
                later = [b.layer_id for b in blocks if b.layer_id > d.layer_id][window - 1: window]
                slot_free = bwd_end.get(later[0], 0.0) if later else 0.0
                for c in range(d.chunks):
                    s, e = op("h2d", f"h2d L{d.layer_id} c{c} (reload)", d.layer_id, c, 1.4e-3 / d.chunks, slot_free)
                    deltas.append((s, rank, weight_bytes[d.layer_id] // d.chunks))
                    if world_size > 1:
                        _, e = op("collective", f"all-gather L{d.layer_id} c{c}", d.layer_id, c, 0.35e-3 / d.chunks, e)
                    ready = max(ready, e)
            if d.activation == "recompute":
                s, ready = op("compute", f"recompute L{d.layer_id}", d.layer_id, 0, 2.0e-3, ready)
                deltas.append((s, rank, 160 * MiB))
            s, t_prev = op("compute", f"bwd L{d.layer_id}", d.layer_id, 0, 4.0e-3 if d.kind == "block" else 1.6e-3, ready)
            bwd_end[d.layer_id] = t_prev
            deltas.append((t_prev, rank, -weight_bytes[d.layer_id] - 24 * MiB - (160 * MiB if d.activation == "recompute" else 0)))
            deltas.append((s, rank, weight_bytes[d.layer_id] * 2))  # the layer's gradient until copied out
            for c in range(d.chunks):
                s2, e2 = op("d2h", f"d2h L{d.layer_id} c{c}", d.layer_id, c, 1.1e-3 / d.chunks, t_prev)
                deltas.append((e2, rank, -weight_bytes[d.layer_id] * 2 // d.chunks))
                deltas.append((s2, -1, weight_bytes[d.layer_id] // d.chunks))
                _, e3 = op("cpu_update", f"update L{d.layer_id} c{c}", d.layer_id, c, 2.2e-3 / d.chunks, e2)
                deltas.append((e3, -1, -weight_bytes[d.layer_id] // d.chunks))
    base = {"device": 600 * MiB, "pinned": 512 * MiB}
    rank0 = sorted((t, b) for t, r, b in deltas if r == 0)
    pinned = sorted((t, b) for t, r, b in deltas if r == -1)
    times = sorted({0.0} | {t for t, _ in rank0} | {t for t, _ in pinned})
    points, dev, pin, i, k = [], base["device"], base["pinned"], 0, 0
    for t in times:
        while i < len(rank0) and rank0[i][0] <= t:
            dev += rank0[i][1]
            i += 1
        while k < len(pinned) and pinned[k][0] <= t:
            pin += pinned[k][1]
            k += 1
        points.append(MemoryPoint(t, dev, pin))
    return tuple(events), tuple(points)


def synthetic_plan(world_size: int = 2, blocks: int = 6, chunks: int = 2, timeline: bool = True) -> Plan:
    decisions = synthetic_decisions(blocks, chunks)
    events, points = synthetic_timeline(decisions, world_size) if timeline else ((), ())
    peak = max((p.device_bytes for p in points), default=2_300 * MiB)
    step = max((e.end_s for e in events), default=0.061)

    def busy(lane):
        return sum(e.end_s - e.start_s for e in events if e.rank == 0 and e.lane == lane)

    predicted = {"compute_s": busy("compute"), "h2d_s": busy("h2d"), "d2h_s": busy("d2h"),
                 "cpu_update_s": busy("cpu_update"), "exposed_s": 0.0042, "step_s": step}
    predicted["bottleneck"] = max(("compute", "h2d", "d2h", "cpu_update"), key=lambda k: predicted[f"{k}_s"])
    return Plan(
        schema_version=SCHEMA_VERSION, slidedp_version="0.1.0", model_fingerprint="3f9a1c0de2b4" * 4,
        model_class="LlamaForCausalLM", workload=Workload(4, 2048, world_size, "bf16", 2),
        budget_bytes=int(peak * 1.25), hardware={"name": "h100-sxm", "gpu_memory_bytes": 80 * 2**30,
                                                  "matmul_flops_per_s": 750e12, "h2d_bytes_per_s": 50e9,
                                                  "d2h_bytes_per_s": 50e9, "cpu_adamw_params_per_s": 6e9,
                                                  "gpu_p2p_bytes_per_s": 450e9},
        schedule=Schedule(window=2, decisions=decisions, window_loads=window_loads(blocks, 2)),
        explanation=Explanation(
            solver={"method": "cp-sat", "status": "FEASIBLE", "relative_gap": 0.031, "wall_s": 2.4, "seed": 0,
                    "chosen_by": "cp-sat"},
            predicted=predicted,
            memory={"resident_params_bytes": 110 * MiB, "weight_slots_bytes": 27 * MiB,
                    "boundary_stash_bytes": 192 * MiB, "block_activation_bytes": peak - 329 * MiB},
            peak_device_bytes=peak,
            notes=("synthetic timeline for the report tests", "blocks 4 and 5 keep their activations"),
            timeline=events, memory_timeline=points),
    )


@pytest.fixture
def make_plan():
    """Factory: make_plan(world_size=2, blocks=6, chunks=2, timeline=True) -> Plan."""
    return synthetic_plan
