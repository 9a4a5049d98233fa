"""The program and its simulator (the oracle), and the two other evaluations of the same model:
the closed form used by local search, and the CP-SAT model with every decision pinned."""

import random
from dataclasses import replace

import pytest

from slidedp.costmodel import ops
from slidedp.costmodel.hardware import PRESETS
from slidedp.scheduler.search import baselines
from slidedp.scheduler.oracles.closed_form import evaluate as closed_form
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.search.cpsat import pinned
from slidedp.scheduler.search.early_order import early_order
from slidedp.scheduler.decisions import KEEP, OFFLOAD, Decisions, LayerChoice, Problem, SolverOptions
from slidedp.scheduler.problem.lanes import GPU_LANES, build_lanes, window_loads
from slidedp.scheduler.oracles.timeline import condition, simulate
from tests.scheduler.graphs import synthetic_graph

GiB = 2**30


def costs_for(n_blocks=4, world_size=1, hardware="h100-sxm", micro_batches=1, **options):
    graph = synthetic_graph(n_blocks, block_scale=(1.0, 0.5, 2.0, 1.0, 1.5, 1.0)[:n_blocks])
    return ProblemCosts(Problem(graph, PRESETS[hardware], world_size, micro_batches), SolverOptions(**options))


def random_decisions(costs: ProblemCosts, rng: random.Random) -> Decisions:
    W = costs.problem.world_size
    routes = [rng.choice(costs.routes) for _ in range(3)]
    layers = []
    for i in range(costs.n_layers):
        route = routes[0] if i == 0 else routes[2] if i == costs.epilogue_id else routes[1]
        activation = rng.choice(costs.options.activations) if i in costs.blocks else "resident"
        layers.append(LayerChoice(W * rng.choice(costs.options.chunk_multiples), activation, *route))
    return Decisions(rng.choice(costs.windows()), rng.choice(costs.options.update_orders), tuple(layers))


@pytest.mark.parametrize("n, w", [(1, 1), (3, 1), (4, 2), (5, 3), (6, 4), (6, 2)])
def test_window_loads(n, w):
    loads = window_loads(n, w)
    forward = [ld for ld in loads if ld.position < n]
    backward = [ld for ld in loads if ld.position >= n]
    assert [ld.block for ld in forward] == list(range(n))  # every block loaded for the forward
    assert len(backward) == max(0, n - w)  # the last `window` blocks are not loaded again
    assert all(ld.issue_after < ld.position for ld in loads)
    assert [ld.issue_after for ld in forward[:w]] == [-1] * min(w, n)  # empty slots: no wait
    if w >= 2 and backward:
        # the slot used first at the turn is evicted first: the reload overlaps the other backward
        assert backward[0].issue_after == n


def test_simulated_step_is_a_program_order_schedule():
    costs = costs_for(4, world_size=2, chunk_multiples=(1, 2))
    d = Decisions(2, "head_first", tuple(
        LayerChoice(4 if i % 2 else 2, a, r[0], r[1]) for i, (a, r) in enumerate(zip(
            ["resident", KEEP, "recompute", OFFLOAD, "recompute", "resident"],
            [("sharded", "gpu")] + [("replicated", "gpu")] * 4 + [("sharded", "cpu")]))))
    sim = simulate(costs, d, record=True)
    # lanes never run two things at once; ranks have identical GPU timelines
    by_lane = {}
    for e in sim.events:
        by_lane.setdefault((e.rank, e.lane), []).append(e)
    for events in by_lane.values():
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    for lane in GPU_LANES:
        r0 = [(e.layer, e.start, e.end) for e in by_lane.get((0, lane), [])]
        r1 = [(e.layer, e.start, e.end) for e in by_lane.get((1, lane), [])]
        assert r0 == r1
    # every op starts after the ops it depends on
    program = build_lanes(costs.n_blocks, d.window, True)
    present = condition(d)
    for lane in GPU_LANES:
        for op in program.lanes[lane]:
            if present(op):
                for dep in op.deps:
                    if dep in sim.ops:
                        assert sim.ops[op.key].start >= sim.ops[dep].end, (op.key, dep)
    # chunk c of the layer at update position p is updated by rank (p + c) mod W
    updates = [e for e in sim.events if e.lane == "cpu_update"]
    position = {layer: p for p, layer in enumerate(d.order(costs.n_layers))}
    assert all(e.rank == (position[e.layer] + e.chunk) % 2 for e in updates)
    # the step ends with its last op; the CPU has finished the previous step's updates by then
    assert sim.makespan == max(e.end for e in sim.events)
    assert max(e.end for e in updates) < sim.makespan


def test_the_next_steps_loads_wait_for_the_update_of_their_chunk():
    costs = costs_for(3, chunk_multiples=(4,))
    d = baselines.uniform(costs, window=2, activation="recompute", chunk_multiple=4)
    sim = simulate(costs, d, record=True)
    update_end = {(e.layer, e.chunk): e.end for e in sim.events if e.lane == "cpu_update"}
    loads = [e for e in sim.events if e.lane == "h2d" and e.name.startswith("load")]
    assert loads and all(e.start >= update_end[(e.layer, e.chunk)] for e in loads)


@pytest.mark.parametrize("world_size, hardware, micro_batches", [
    (1, "h100-sxm", 1), (2, "h100-sxm", 2), (3, "h200-sxm", 1), (2, "rtx4090", 1)])
def test_closed_form_and_pinned_model_agree_with_the_simulator(world_size, hardware, micro_batches):
    costs = costs_for(4, world_size, hardware, micro_batches, chunk_multiples=(1, 2))
    rng = random.Random(world_size)
    decisions = [random_decisions(costs, rng) for _ in range(60)]
    for d in decisions:
        full = simulate(costs, d).makespan
        assert simulate(costs, d, all_ranks=False).makespan == full
        assert closed_form(costs, d).makespan == full
    for d in decisions[:4]:
        assert pinned(costs, d, 1 << 50)[0] == simulate(costs, d).makespan


def test_memory_over_program_order():
    costs = costs_for(3)
    base = baselines.uniform(costs, window=1, activation="recompute")
    keep = base.replace_layers([2], activation=KEEP)
    off = base.replace_layers([2], activation=OFFLOAD)
    a, b, c = (simulate(costs, d).footprint for d in (base, keep, off))
    held = costs.blocks[2].saved_bytes
    # a kept block holds its saved activations from its forward (position 2) to its backward (6)
    assert [y - x for x, y in zip(a.per_position, b.per_position)] == [0, 0, held, held, held, held, 0, 0, 0]
    # an offloaded one only around its forward and backward; both drop the recompute's working set
    diff = [y - x for x, y in zip(a.per_position, c.per_position)]
    assert diff[2] == diff[3] == diff[5] == held and diff[4] == 0 and diff[6] == 0
    assert a.peak_bytes == sum(a.breakdown.values())
    wider = simulate(costs, base.__class__(2, base.update_order, base.layers)).footprint
    assert wider.peak_bytes - a.peak_bytes == costs.weight_slots_bytes(1)


@pytest.mark.parametrize("hardware, on_device", [("h200-sxm", {0, 1, 2}), ("h200-sxm", set(range(8))),
                                                 ("a100-sxm", set(range(8))), ("h200-sxm", {0, 3, 4, 7})])
def test_device_updates_delay_the_forward_by_their_largest_overrun(hardware, on_device):
    """The device's AdamW runs beside the next forward in forward order; the forward starts late by
    the most any update (with those before it) runs past the forward of the layers before it, for
    any set of layers on the device. Brute force: an event walk over the forward, pausing before each
    layer until it is updated."""
    graph = synthetic_graph(6, block_scale=(1.0, 0.5, 2.0, 1.0, 1.5, 1.0))
    on_device = frozenset(on_device)
    plain = ProblemCosts(Problem(graph, PRESETS[hardware], 1, 1), SolverOptions())
    costs = ProblemCosts(Problem(graph, PRESETS[hardware], 1, 1, device_state=on_device), SolverOptions())
    update = {layer.id: costs.scale.ticks(ops.device_update_time_s(layer.numel, PRESETS[hardware]))
              for layer in graph.layers if layer.id in on_device}
    fwd = {0: plain.prologue_fwd, **{i: b.fwd for i, b in costs.blocks.items()}, costs.epilogue_id: 0}
    best = None
    for delay in range(sum(update.values()) + 1):  # the least start delay with no pause
        clock, updated, ok = delay, 0, True
        for layer_id in sorted(fwd):
            updated += update.get(layer_id, 0)
            if layer_id in update and updated > clock:
                ok = False
                break
            clock += fwd[layer_id]
        if ok:
            best = delay
            break
    d = baselines.uniform(costs, window=1, activation="recompute")
    assert d.device_state == on_device and costs.device_update(on_device) == best
    assert costs.prologue_fwd_ticks(d) == plain.prologue_fwd + best
    assert 0 < best <= sum(update.values())


@pytest.mark.parametrize("k, early", [(1, False), (3, False), (6, False), (2, True)])
def test_streamed_updates_leave_the_cpu_and_gate_their_loads(k, early):
    """Streamed layers (a prefix of the host layers in update order) are not on the CPU lane; their
    pieces head the H2D and D2H lanes, each piece down after it is up, a piece up only after the one
    two before it is down (two slots); each forward load of a streamed layer starts after its last
    piece is down; the step is at least the transfers' and the GPU's own."""
    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    costs = ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, 1, streamed_updates=True,
                                 early_host_bytes=1 << 50 if early else None), SolverOptions())
    d = baselines.uniform(costs, window=2, activation="recompute")
    d = replace(d, streamed=d.order(costs.n_layers)[:k])
    plain = replace(d, streamed=())
    if early:
        d = replace(d, early_order=early_order(costs, d, 2))
        plain = replace(plain, early_order=early_order(costs, plain, 2))
    plain = simulate(costs, plain, record=True)
    sim = simulate(costs, d, record=True)
    cpu = {e.layer for e in sim.events if e.lane == "cpu_update"}
    assert cpu.isdisjoint(d.streamed) and cpu | set(d.streamed) == {e.layer for e in plain.events
                                                                   if e.lane == "cpu_update"}
    def by_start(prefix):
        return sorted((e for e in sim.events if e.name.startswith(prefix)), key=lambda e: e.start)

    ups, downs = by_start("state up"), by_start("update+state down")
    pieces = sum(len(p) for i in d.streamed for p in costs.streamed_pieces[(i, d.layers[i].chunks)])
    assert len(ups) == len(downs) == pieces
    h2d = sorted((e for e in sim.events if e.lane == "h2d"), key=lambda e: e.start)
    assert [e.name for e in h2d[:pieces]] == [e.name for e in ups]
    for i, (up, down) in enumerate(zip(ups, downs)):
        assert (up.layer, up.chunk) == (down.layer, down.chunk) and down.start >= up.end
        assert i < 2 or up.start >= downs[i - 2].end  # two slots
    last_down = {i: max(e.end for e in downs if e.layer == i) for i in d.streamed}
    loads = [e for e in sim.events if e.lane == "h2d" and e.name.startswith("load") and e.layer in last_down]
    assert loads and all(e.start >= last_down[e.layer] for e in loads)
    ticks = sum(u for i in d.streamed for p in costs.streamed_pieces[(i, d.layers[i].chunks)] for u, _ in p)
    assert sim.lane_busy["cpu_update"] < plain.lane_busy["cpu_update"]
    assert sim.makespan >= max(ticks, sim.lane_busy["compute"])
    with pytest.raises(ValueError, match="streamed"):
        simulate(ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, 1), SolverOptions()), d)


def test_moving_optimizer_state_keeps_streamed_and_early_updates_to_host_layers():
    """A layer's state moved to the device or back (local search, the plan's alternatives) leaves the
    streamed updates a prefix of the host layers in update order and the early order (here: streamed
    gradients, every host layer as it lands) over the host layers: every move simulates."""
    from slidedp.scheduler.search.local_search import device_state_moves
    from slidedp.scheduler.search.streamed_prefix import candidates

    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    every = frozenset(layer.id for layer in graph.layers)
    costs = ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, 1, device_state_optional=every,
                                 streamed_updates=True, grads_streamable=True), SolverOptions())
    d = baselines.uniform(costs, window=1, activation="recompute", on_device={1, 2})
    host = [i for i in range(costs.n_layers - 2, -1, -1) if i not in (1, 2)] + [costs.n_layers - 1]
    for start in (replace(d, streamed=candidates(costs, d)[:2]),
                  replace(d, early_order=tuple(host), grads_streamed=True)):
        simulate(costs, start)
        moves = list(device_state_moves(costs, start))
        assert {frozenset(e.device_state) for e in moves} == {frozenset({1, 2, 3}), frozenset({1}),
                                                             frozenset({0, 1, 2})}
        for e in moves:
            simulate(costs, e)
            assert not (set(e.early_order) | set(e.streamed)) & e.device_state
            assert e.streamed == candidates(costs, e)[:len(start.streamed)]
            assert len(e.early_order) == (costs.n_layers - len(e.device_state) if start.early_order else 0)


def test_streamed_layers_must_be_host_layers_without_early_updates():
    graph = synthetic_graph(3)
    costs = ProblemCosts(Problem(graph, PRESETS["h200-sxm"], 1, 1, device_state=frozenset({1}), streamed_updates=True,
                                 early_host_bytes=1 << 50), SolverOptions())
    d = baselines.uniform(costs, window=1, activation="recompute")
    for bad in [replace(d, streamed=(1,)), replace(d, streamed=(2, 2)),
                replace(d, streamed=(2,), early_order=(2, 3, 4, 0))]:
        with pytest.raises(ValueError, match="streamed layers"):
            simulate(costs, bad)


def test_best_streamed_count_is_found_and_never_slower():
    """On a CPU-bound problem the search over the streamed prefix (8 host layers: its coarse sweep
    tries every k) finds the best k of a brute force, k > 0; a fixed k is taken as given; nothing
    is streamed unless the problem allows it."""
    from slidedp.scheduler.search.streamed_prefix import best_streamed, candidates

    graph = synthetic_graph(6, block_scale=(1.0, 0.5, 2.0, 1.0, 1.5, 1.0))
    hw = replace(PRESETS["h200-sxm"], cpu_adamw_params_per_s=0.3e9)  # a slow CPU: the updates bound the step
    costs = ProblemCosts(Problem(graph, hw, 1, 1, streamed_updates=True), SolverOptions())
    d = baselines.uniform(costs, window=2, activation="recompute")
    found = best_streamed(costs, d, 1 << 50)
    assert found is not None
    e, sim, tried = found
    brute = {k: simulate(costs, replace(d, streamed=candidates(costs, d)[:k])).makespan
             for k in range(len(candidates(costs, d)) + 1)}
    assert e.streamed and sim.makespan == min(brute.values()) < brute[0]
    assert tried[0] == pytest.approx(brute[0] * costs.scale.tick_s)
    fixed = ProblemCosts(Problem(graph, hw, 1, 1, streamed_updates=True), SolverOptions(streamed_layers=2))
    assert best_streamed(fixed, d, 1 << 50)[0].streamed == candidates(costs, d)[:2]
    assert best_streamed(ProblemCosts(Problem(graph, hw, 1, 1), SolverOptions()), d, 1 << 50) is None


def test_streamed_updates_with_several_ranks_split_by_chunk_owner():
    """Each rank streams the chunks it owns on its own lanes; together every chunk once; a load of a
    streamed layer on any rank starts after that rank's last piece of the layer is down; the CPU
    lanes do not update streamed layers; streaming shortens the step of a CPU-bound problem."""
    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    hw = replace(PRESETS["h200-sxm"], cpu_adamw_params_per_s=0.3e9)
    costs = ProblemCosts(Problem(graph, hw, 2, 1, streamed_updates=True), SolverOptions())
    d = baselines.uniform(costs, window=2, activation="recompute", chunk_multiple=2)
    d = replace(d, streamed=d.order(costs.n_layers)[:3])
    sim = simulate(costs, d, record=True)
    order = d.order(costs.n_layers)
    for layer in d.streamed:
        k = d.layers[layer].chunks
        ups = [e for e in sim.events if e.name.startswith("state up") and e.layer == layer]
        assert sorted({(e.rank, e.chunk) for e in ups}) == sorted(
            (costs.owner(order.index(layer), c), c) for c in range(k))
        assert len(ups) == sum(len(p) for p in costs.streamed_pieces[(layer, k)])
        for r in range(2):
            last = max(e.end for e in sim.events if e.rank == r and e.layer == layer and e.name.startswith("update+"))
            loads = [e for e in sim.events if e.rank == r and e.layer == layer and e.name.startswith("load")]
            assert loads and all(e.start >= last for e in loads)
    assert not any(e.lane == "cpu_update" and e.layer in d.streamed for e in sim.events)
    assert sim.makespan < simulate(costs, replace(d, streamed=())).makespan


def test_streamed_updates_get_room_from_a_narrower_window():
    """When the chosen decisions leave no room for the streamed updates' slots, the search tries a
    weight window one slot narrower: streaming there beats not streaming (a CPU-bound step)."""
    from slidedp.costmodel.memory import streamed_update_bytes
    from slidedp.scheduler.search.streamed_prefix import best_streamed

    graph = synthetic_graph(6, block_numel=256 << 20)  # a weight slot: 512 MiB in bf16
    hw = replace(PRESETS["h200-sxm"], cpu_adamw_params_per_s=0.3e9)  # a slow CPU: the updates bound the step
    costs = ProblemCosts(Problem(graph, hw, 1, 1, streamed_updates=True), SolverOptions())
    d = baselines.uniform(costs, window=2, activation="recompute")
    plain = simulate(costs, d)
    budget = plain.peak_bytes + streamed_update_bytes(2) // 2  # half the slots' room at window 2
    assert costs.fits(d, plain.peak_bytes, budget)
    e, sim, tried = best_streamed(costs, d, budget)
    assert e.window == 1 and e.streamed and sim.makespan < plain.makespan
    assert costs.fits(e, sim.peak_bytes, budget)
    assert best_streamed(costs, d, 1 << 50)[0].window == 2  # with room, the window stays


def test_streamed_update_copies_run_at_the_rate_left_beside_the_cpu_adamw():
    """The streamed updates' round trips run at the step boundary beside the CPU's AdamW: their copies
    take 1 / duplex_contended_fraction as long; the loads and gradient copies keep their rates."""
    graph = synthetic_graph(4, block_scale=(1.0, 0.5, 2.0, 1.0))
    idle = replace(PRESETS["h200-sxm"], duplex_contended_fraction=1.0)
    half = replace(idle, duplex_contended_fraction=0.5)
    a, b = (ProblemCosts(Problem(graph, hw, 1, 1, streamed_updates=True), SolverOptions()) for hw in (idle, half))
    assert a.scale == b.scale
    for key, chunks in a.streamed_pieces.items():
        for pieces_a, pieces_b in zip(chunks, b.streamed_pieces[key]):
            for (up_a, down_a), (up_b, down_b) in zip(pieces_a, pieces_b):
                assert up_b == pytest.approx(2 * up_a, abs=2) and down_b > 1.8 * down_a
    assert a.layer_options == b.layer_options
    # not known (0): as if idle
    unknown = ProblemCosts(Problem(graph, replace(idle, duplex_contended_fraction=0.0), 1, 1, streamed_updates=True),
                           SolverOptions())
    assert unknown.streamed_pieces == a.streamed_pieces


def test_the_loss_chunk_is_charged_as_the_epilogue_computes_it():
    """A plain linear head takes the fused loss (fp32 logits and bf16 dlogits of a chunk: 6 B a logit);
    a head whose logits the model changes after it (LayerGraph.linear_head false) the model's own logits
    through autograd (12 B a logit), over the whole micro-batch."""
    graph = synthetic_graph(2, vocab=32000, hidden=2048, tokens=4096)

    def epilogue_bytes(g):
        return ProblemCosts(Problem(g, PRESETS["h100-sxm"], 1, 1), SolverOptions()).epilogue_working_bytes

    assert epilogue_bytes(replace(graph, linear_head=False)) - epilogue_bytes(graph) == 4096 * 32000 * (12 - 6)
