"""Early updates (plan.early_order: one rank, no clipping): each layer is updated as its gradient
lands, out of place, and kept once the whole gradient is finite. The training is torch.optim.AdamW's;
a non-finite step or a failed one leaves the state as it was; the planner uses them only where
allowed, and the simulator's steady state is what they make of a step. With nonfinite="stop" they are
written in place (plan.early_in_place): the same training, no spare state, and a non-finite step
stops with the state named part-applied."""

import copy
import random
import threading
import time

import pytest
import torch

import slidedp
from slidedp.backend.kernels import cpu_adamw
from slidedp.costmodel.hardware import PRESETS
from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import Problem, SolverOptions
from slidedp.scheduler.search import baselines
from slidedp.scheduler.search.early_order import best_early, early_order, landing_order
from slidedp.scheduler.oracles.timeline import simulate
from slidedp.scheduler.solve import solve_plan
from tests.engine.test_exactness import BATCH, LR, SEQ, WD, random_batch, reference_loss
from tests.models import VOCAB, make_model
from tests.scheduler.graphs import synthetic_graph
from tests.reliability.test_numerical_faults import poison, snapshot

KW = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")


def early_plan(model, landed_first: int | None = None, **kw):
    """The solved plan of `model` with early updates of every layer (first `landed_first` in landing order)."""
    plan = slidedp.plan(model, "1GiB", **KW, **kw)
    n = len(plan.decisions)
    load = [i for i in range(n) if i not in plan.device_state]
    m = len(load) if landed_first is None else landed_first
    first = [i for i in landing_order(n) if i in load][:m]
    return plan.replace(early_order=tuple(first) + tuple(i for i in load if i not in first))


def compiled(model, plan, max_grad_norm=None, **kw):
    return slidedp.compile(model, "1GiB", **KW, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD),
                           max_grad_norm=max_grad_norm, plan=plan, **kw)


def train_beside_late(engine, late, ref, steps, seed):
    """`steps` steps of `engine` (early updates), of `late` (the same plan, updated after the backward)
    and of torch.optim.AdamW on `ref`, on the same batches: the losses are `late`'s exactly and
    torch's within 1e-5; the state and the model's parameters (views of the current master) are
    `late`'s bit for bit.

    Not torch's parameters within a tolerance: in another order of summation, a gradient element
    below AdamW's eps is rounding noise that its update scales by lr/eps (gpt2's h.1.ln_2.bias here:
    1e-9, computed as 7e-10 to 8e-10 depending on torch's thread count), so the late engine's
    agreement with torch is test_exactness.py's, with clipping."""
    gen = torch.Generator().manual_seed(seed)
    batches = [random_batch(gen, 2 * BATCH) for _ in range(steps)]
    losses = [engine.step(ids, labels) for ids, labels in batches]  # back to back: each meets the last round
    assert losses == [late.step(ids, labels) for ids, labels in batches]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for (ids, labels), loss in zip(batches, losses):
        ref_loss = reference_loss(ref, ids, labels)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    state, late_state = engine.state_dict(), late.state_dict()
    assert state.keys() == late_state.keys()
    for name, value in late_state.items():
        assert torch.equal(state[name], value), name
    for name, _ in ref.named_parameters():
        assert torch.equal(engine.model.get_parameter(name).detach(), state[name]), name


def early_and_late(family, tied, micro_batches, landed_first):
    """A fresh model's engine with early updates, one of the same plan without, and torch's copy."""
    model = make_model(family, tied=tied)
    ref, late_model = copy.deepcopy(model).eval(), copy.deepcopy(model)
    plan = early_plan(model, landed_first, micro_batches=micro_batches)
    engine = compiled(model, plan, micro_batches=micro_batches)
    late = compiled(late_model, plan.replace(early_order=()), micro_batches=micro_batches)
    assert engine.runner.early is not None and late.runner.early is None
    assert all(layer.spare is not None for layer in engine.host.layers)
    return engine, late, ref


CASES = [
    ("llama", False, 2, None),  # one pass: every layer as it lands
    ("gpt2", True, 2, 2),  # a tied head (the prologue's gradient sums both uses): then load order
    ("qwen3", False, 1, 3),  # two passes: the second pass's host-side adds are waited for
]


@pytest.mark.parametrize("family, tied, micro_batches, landed_first", CASES)
def test_early_updates_are_exact(family, tied, micro_batches, landed_first):
    engine, late, ref = early_and_late(family, tied, micro_batches, landed_first)
    with engine, late:
        train_beside_late(engine, late, ref, steps=3, seed=5)


@pytest.mark.parametrize("family, tied, micro_batches, landed_first", CASES[1:])
def test_early_updates_are_exact_whatever_the_timing(monkeypatch, family, tied, micro_batches, landed_first):
    """Delays where the early round meets the step: a slow update kernel (the round runs into the
    next step's loads and gradient copies, and into the commit), a slow landing (the gradient is told
    late), slow host-side adds of the second pass (the reducer thread), a slow commit. Still the
    late engine's result, bit for bit."""
    from slidedp.backend.runtime import early_updates, routes

    rng = random.Random(0)
    lock = threading.Lock()

    def delayed(real):
        def call(*args, **kw):
            with lock:
                pause = rng.choice((0.0, 0.005, 0.02))
            time.sleep(pause)
            return real(*args, **kw)
        return call

    real_stage = routes.Routes._stage

    def stage(self, chunk, acc, add):
        real_stage(self, chunk, acc, delayed(add))

    engine, late, ref = early_and_late(family, tied, micro_batches, landed_first)
    monkeypatch.setattr(cpu_adamw, "adamw_step", delayed(cpu_adamw.adamw_step))
    monkeypatch.setattr(early_updates.EarlyRound, "land", delayed(early_updates.EarlyRound.land))
    monkeypatch.setattr(early_updates.EarlyUpdates, "commit", delayed(early_updates.EarlyUpdates.commit))
    monkeypatch.setattr(routes.Routes, "_stage", stage)
    with engine, late:
        train_beside_late(engine, late, ref, steps=3, seed=7)


def test_updates_start_during_the_backward_in_the_planned_order(monkeypatch):
    model = make_model("llama")
    plan = early_plan(model, landed_first=2)
    engine = compiled(model, plan)
    spans = []
    for arrays in engine.host.layers:
        for t in (arrays.master, arrays.spare[0]):
            spans.append((t.data_ptr(), t.data_ptr() + 4 * t.numel(), arrays.layout.layer_id))
    seen, real = [], cpu_adamw.adamw_step

    def recording(param, *args, **kw):
        assert kw.get("to") is not None  # out of place: the current state stays untouched
        seen.append(next(i for lo, hi, i in spans if lo <= param.ctypes.data < hi))
        return real(param, *args, **kw)

    monkeypatch.setattr(cpu_adamw, "adamw_step", recording)
    with engine:
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
        engine.updates.flush()
    order = [i for k, i in enumerate(seen) if k == 0 or seen[k - 1] != i]
    assert tuple(order) == plan.early_order
    n = len(plan.decisions)
    assert order[:2] == [n - 2, n - 3]  # the last blocks' gradients land first


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_non_finite_gradient_takes_the_early_updates_back(where):
    """Block 1's gradient turns non-finite after later layers were updated: the step is skipped and
    master, moments, delivery copy and step count are as before, bit for bit."""
    switch = {"on": False}
    model = make_model("llama")
    poison(model, where, switch)
    clean_model = copy.deepcopy(make_model("llama"))
    engine, clean = compiled(model, early_plan(model)), compiled(clean_model, early_plan(clean_model))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g) for _ in range(3)]
    engine.step(batches[0])
    clean.step(batches[0])
    before, step = snapshot(engine)
    switch["on"] = True
    engine.step(batches[1])
    switch["on"] = False
    assert engine.last_step.skipped
    after, step_after = snapshot(engine)
    assert step_after == step and all(torch.equal(x, y) for x, y in zip(before, after))
    engine.step(batches[2])
    clean.step(batches[2])
    ours, theirs = engine.state_dict(), clean.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    engine.close()
    clean.close()


def test_a_failed_step_takes_the_early_updates_back(monkeypatch):
    """An error in the backward (after some layers were updated early) leaves the state as before."""
    model = make_model("llama")
    engine = compiled(model, early_plan(model, micro_batches=2), micro_batches=2)  # one pass per step
    engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    before, step = snapshot(engine)
    executor = engine.runner.executor
    real = executor._op_prologue_bwd

    def broken(*args, **kw):
        deadline = time.monotonic() + 10
        while not engine.runner.early.round.updated and time.monotonic() < deadline:
            time.sleep(0.01)  # some layers are updated before the failure
        assert engine.runner.early.round.updated
        raise RuntimeError("backward failed")

    monkeypatch.setattr(executor, "_op_prologue_bwd", broken)
    with pytest.raises(RuntimeError, match="backward failed"):
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    monkeypatch.setattr(executor, "_op_prologue_bwd", real)
    after, step_after = snapshot(engine)
    assert step_after == step and all(torch.equal(x, y) for x, y in zip(before, after))
    engine.close()


def test_early_plans_need_no_clipping_and_one_rank():
    model = make_model("llama")
    plan = early_plan(model)
    with pytest.raises(ValueError, match="max_grad_norm=None"):
        compiled(model, plan, max_grad_norm=1.0)
    assert slidedp.plan(model, "1GiB", **KW, max_grad_norm=1.0).early_order == ()
    assert slidedp.Plan.from_dict(plan.to_dict()) == plan
    assert "early updates" in plan.summary()


def test_simulated_early_updates_overlap_the_backward():
    """A CPU-heavy model on the H200 profile: early updates shorten the simulated step, the steady
    state still fits the CPU's work in one step, and the planner takes them only when allowed."""
    graph = synthetic_graph(8, block_numel=256 << 20, flops_fwd=2e13)  # compute about the CPU work
    hw = PRESETS["h200-sxm"]
    options = SolverOptions(device_state_blocks=0)
    costs = ProblemCosts(Problem(graph, hw, early_host_bytes=1 << 62), options)
    d = baselines.BASELINES["recompute-all"](costs, 1 << 40)
    boundary = simulate(costs, d)
    best, early = best_early(costs, d)
    assert sorted(best.early_order) == list(range(len(graph.layers)))
    assert early.makespan < boundary.makespan
    assert early.makespan >= max(early.lane_busy.values())  # the CPU's work fits in the period
    n = len(graph.layers)
    assert early_order(costs, d, 0) == tuple(range(n))  # none as they land: the load order
    assert early_order(costs, d, 2) == (n - 2, n - 3) + tuple(range(n - 3)) + (n - 1,)
    plans = {limit: solve_plan(graph, budget_bytes=40 << 30, hardware=hw, options=options, early_host_bytes=limit)
             for limit in (None, 1 << 62, 0)}
    assert plans[1 << 62].early_order and plans[1 << 62].predicted_step_time_s < plans[None].predicted_step_time_s
    assert plans[None].early_order == () and plans[0].early_order == ()  # not allowed / no room for the spare


# -- in place: nonfinite="stop" -------------------------------------------------------------------


def in_place(plan):
    return plan.replace(early_in_place=True)


def test_in_place_early_updates_are_exact_and_keep_no_spare(monkeypatch):
    """nonfinite="stop": the early updates write over the state they read (no `to`, no spare arrays in
    the host state), and train as the same plan updated after the backward, bit for bit."""
    model = make_model("qwen3")
    ref, late_model = copy.deepcopy(model).eval(), copy.deepcopy(model)
    plan = in_place(early_plan(model, landed_first=3))
    engine = compiled(model, plan, nonfinite="stop")
    late = compiled(late_model, plan.replace(early_order=(), early_in_place=False))
    assert engine.runner.early.in_place and all(layer.spare is None for layer in engine.host.layers)
    outs, real = [], cpu_adamw.adamw_step

    def recording(*args, **kw):
        outs.append(kw.get("to"))
        return real(*args, **kw)

    monkeypatch.setattr(cpu_adamw, "adamw_step", recording)
    with engine, late:
        train_beside_late(engine, late, ref, steps=3, seed=11)
    assert outs and all(to is None for to in outs)


def test_in_place_early_plans_need_nonfinite_stop():
    model = make_model("llama")
    plan = in_place(early_plan(model))
    with pytest.raises(ValueError, match="early_in_place"):
        compiled(model, plan)  # nonfinite="skip": a round must be able to be taken back
    data = plan.to_dict()
    data["schedule"]["early_order"] = []
    with pytest.raises(ValueError, match="early_in_place"):
        slidedp.Plan.from_dict(data).validate()
    assert slidedp.Plan.from_dict(plan.to_dict()) == plan
    assert "in place" in plan.summary()


def stops_part_applied(engine, switch, tmp_path) -> None:
    """A step whose gradient turns non-finite (`switch`, tests/reliability's poison) after layers were
    written in place: it raises, naming the state part-applied, and the engine refuses steps, checkpoints
    and exports until the checkpoint taken before loads; then it trains on."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g) for _ in range(3)]
    engine.step(batches[0])
    engine.save_checkpoint(tmp_path / "ckpt")
    switch["on"] = True
    with pytest.raises(slidedp.NonFiniteGradientError, match="part-applied"):
        engine.step(batches[1])
    switch["on"] = False
    with pytest.raises(slidedp.NonFiniteGradientError, match="load a checkpoint"):
        engine.step(batches[2])
    with pytest.raises(RuntimeError, match="not saved: .*part-applied"):  # no checkpoint of half a step
        engine.save_checkpoint(tmp_path / "half")
    with pytest.raises(RuntimeError, match="not exported"):
        engine.export_hf(tmp_path / "half-export")
    assert not (tmp_path / "half").exists() and not (tmp_path / "half-export").exists()
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.step(batches[2])
    engine.save_checkpoint(tmp_path / "after")  # whole again
    engine.close()


def test_a_non_finite_gradient_stops_in_place_early_updates_part_applied(tmp_path):
    """Block 1's gradient turns non-finite after later layers were written in place early."""
    switch = {"on": False}
    model = make_model("llama")
    poison(model, "backward", switch)
    stops_part_applied(compiled(model, in_place(early_plan(model)), nonfinite="stop"), switch, tmp_path)


def test_the_planner_writes_early_updates_in_place_where_nonfinite_stops():
    """With a non-finite gradient stopping training the early updates need no spare state, and run at the
    CPU's in-place rate (cpu_adamw_contended_fraction), not the out-of-place one (backward fraction)."""
    graph = synthetic_graph(8, block_numel=256 << 20, flops_fwd=2e13)
    hw = PRESETS["h200-sxm"]
    options = SolverOptions(device_state_blocks=0)
    spare, inplace = (ProblemCosts(Problem(graph, hw, early_host_bytes=1 << 62, early_in_place=flag), options)
                      for flag in (False, True))
    d = baselines.BASELINES["recompute-all"](spare, 1 << 40)
    (best_spare, sim_spare), (best_in, sim_in) = best_early(spare, d), best_early(inplace, d)
    assert spare.spare_bytes(best_spare) > 0 and inplace.spare_bytes(best_in) == 0
    o = spare.option_of(1, d.layers[1])
    assert inplace.early_piece(o) == o.update_piece < spare.early_piece(o)
    assert sim_in.lane_busy["cpu_update"] < sim_spare.lane_busy["cpu_update"]
    plans = {nf: solve_plan(graph, budget_bytes=1 << 40, hardware=hw, options=options, early_host_bytes=1 << 62,
                            grads_streamable=nf == "stop", explain=False) for nf in ("skip", "stop")}
    assert plans["skip"].early_order and not plans["skip"].early_in_place
    assert plans["skip"].host_memory["spare"] > 0
    assert "with nonfinite='stop' they would write in place" in plans["skip"].summary()  # the user is told
    assert "they would write in place" not in plans["stop"].summary()
    stop = plans["stop"]
    assert stop.streamed_gradients or (stop.early_in_place and stop.host_memory["spare"] == 0)


def test_each_step_says_how_long_the_cpu_round_it_waited_on_and_its_blocks_issue_took():
    """StepInfo.update_s: the wall time of the CPU's round of updates after the previous step's boundary
    (none before the first); a plan whose host updates run early has its rounds untimed (None)."""
    model = make_model("llama")
    gen = torch.Generator().manual_seed(3)
    with slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                         optimizer=slidedp.AdamW(lr=LR), max_grad_norm=1.0) as engine:
        assert not engine.plan.early_order
        rounds = []
        for _ in range(3):
            engine.step(*random_batch(gen, BATCH))
            rounds.append(engine.last_step.update_s)
            # the host's time issuing the blocks is part of the pass (on the CPU it is their compute)
            assert 0 < engine.last_step.block_issue_s < engine.last_step.pass_s
        assert rounds[0] is None and all(s is not None and 0 < s < 60 for s in rounds[1:])
    model = make_model("llama")
    with compiled(model, early_plan(model)) as engine:
        assert engine.plan.early_order
        for _ in range(2):
            engine.step(*random_batch(gen, BATCH))
            assert engine.last_step.update_s is None
