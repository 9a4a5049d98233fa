"""Streamed updates (plan.streamed_updates: one rank): some host layers are updated on the device at
the step boundary, their fp32 state making a round trip through it piece by piece. The training is
torch.optim.AdamW's, with or without clipping, beside device state and early updates; a non-finite
step changes nothing; the planner streams layers only where allowed."""

import copy

import pytest
import torch

import slidedp
from slidedp.costmodel import memory
from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.solve import solve_plan
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, random_batch, train_side_by_side
from tests.models import make_model
from tests.reliability.test_numerical_faults import poison, snapshot

GiB = 2**30


def streamed_plan(model, k: int, *, micro_batches: int = 2, device_blocks: int = 0, early: bool = False):
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)
    return solve_plan(graph, budget_bytes=GiB, hardware=PRESETS["cpu"], precision="fp32",
                      micro_batches=micro_batches, streamed_updates=True,
                      early_host_bytes=1 << 40 if early else None,
                      options=SolverOptions(streamed_layers=k, device_state_blocks=device_blocks))


def compiled(model, plan, max_grad_norm=CLIP, micro_batches=2, no_decay=False):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           optimizer=slidedp.AdamW(lr=LR, weight_decay=WD, no_decay_groups=no_decay),
                           max_grad_norm=max_grad_norm, plan=plan, micro_batches=micro_batches)


@pytest.mark.parametrize("family, tied, k, micro_batches, clip, device_blocks", [
    ("llama", False, 2, 2, CLIP, 0),  # the prologue and block 1; two passes over the weights
    ("gpt2", True, 5, 1, CLIP, 0),  # every layer, a tied head (its gradient is the prologue's)
    ("qwen3", False, 3, 2, None, 1),  # beside block 1's device state, the rest as early updates
])
def test_streamed_updates_are_exact(monkeypatch, family, tied, k, micro_batches, clip, device_blocks):
    monkeypatch.setattr(memory, "STREAMED_PIECE_NUMEL", 1000)  # several pieces a layer, across decay runs
    model = make_model(family, tied=tied)
    ref = copy.deepcopy(model).eval()
    plan = streamed_plan(model, k, micro_batches=micro_batches, device_blocks=device_blocks, early=clip is None)
    host_layers = [i for i in plan.update_order if i not in plan.device_state]
    assert plan.streamed_updates == tuple(host_layers[:k])
    assert set(plan.early_order).isdisjoint(plan.streamed_updates)
    assert plan.memory["streamed_update_bytes"] > 0 and "streamed updates" in plan.summary()
    assert slidedp.Plan.from_dict(plan.to_dict()) == plan
    with compiled(model, plan, max_grad_norm=clip, micro_batches=micro_batches) as engine:
        streamed = engine.runner.streamed
        assert streamed is not None and streamed.order == list(plan.streamed_updates)
        assert streamed.piece_numel == 1000
        assert set(engine.runner.updates.order).isdisjoint(plan.streamed_updates)  # not on the CPU
        train_side_by_side(engine, ref, steps=3, seed=7, clip=clip)


def test_no_decay_groups_split_pieces_exactly(monkeypatch):
    """Weight decay per parameter run inside a piece: the same as the CPU optimizer's."""
    monkeypatch.setattr(memory, "STREAMED_PIECE_NUMEL", 777)
    plan = streamed_plan(make_model("llama"), 3)
    states = []
    for streamed in (True, False):
        torch.manual_seed(0)
        model = make_model("llama")
        the_plan = plan if streamed else streamed_plan(model, 0)
        with compiled(model, the_plan, no_decay=True) as engine:
            gen = torch.Generator().manual_seed(3)
            for _ in range(2):
                engine.step(torch.randint(0, 64, (2 * BATCH, SEQ), generator=gen))
            states.append(engine.state_dict())
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_non_finite_step_changes_nothing():
    model = make_model("llama")
    switch = {"on": False}
    poison(model, "backward", switch)
    plan = streamed_plan(model, 3)
    with compiled(model, plan) as engine:
        gen = torch.Generator().manual_seed(1)
        engine.step(torch.randint(0, 64, (2 * BATCH, SEQ), generator=gen))
        before, step = snapshot(engine)
        switch["on"] = True
        engine.step(torch.randint(0, 64, (2 * BATCH, SEQ), generator=gen))
        assert engine.last_step.skipped
        after, step_after = snapshot(engine)
        assert step_after == step and all(torch.equal(x, y) for x, y in zip(before, after))


def test_planner_streams_only_where_allowed():
    model = make_model("llama")
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)
    plan = solve_plan(graph, budget_bytes=GiB, hardware=PRESETS["cpu"], precision="fp32", micro_batches=2,
                      options=SolverOptions(streamed_layers=2))
    assert plan.streamed_updates == ()  # Problem.streamed_updates is off: the option changes nothing
    searched = solve_plan(graph, budget_bytes=GiB, hardware=PRESETS["cpu"], precision="fp32", micro_batches=2,
                          streamed_updates=True)
    tried = searched.solver["streamed_tried"]
    assert len(tried) > 1 and searched.predicted_step_time_s == pytest.approx(min(tried.values()), rel=1e-6)
    assert any(a.decision == "streamed updates" for a in searched.alternatives)
    cpu = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    assert cpu.streamed_updates == ()  # the CPU preset has no device bandwidth: never offered
    with pytest.raises(ValueError, match="streamed_layers"):
        SolverOptions(streamed_layers=-1)


def test_checkpoint_round_trip(tmp_path, monkeypatch):
    """A checkpoint saved mid-run (the streamed round of the last step written back first) and loaded
    into a fresh engine continues exactly like the uninterrupted one."""
    monkeypatch.setattr(memory, "STREAMED_PIECE_NUMEL", 1500)
    model = make_model("llama")
    plan = streamed_plan(model, 3, micro_batches=1)  # two passes of one micro-batch a step
    gen = torch.Generator().manual_seed(5)
    batches = [random_batch(gen, 2 * BATCH) for _ in range(4)]
    with compiled(model, plan, micro_batches=1) as engine:
        for b in batches[:2]:
            engine.step(*b)
        engine.save_checkpoint(tmp_path / "ckpt")
        losses = [engine.step(*b) for b in batches[2:]]
        final = engine.state_dict()
    with compiled(make_model("llama", seed=1), plan, micro_batches=1) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert [engine.step(*b) for b in batches[2:]] == losses
        resumed = engine.state_dict()
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


def test_a_plan_streaming_a_layer_twice_is_refused():
    model = make_model("llama")
    plan = streamed_plan(model, 2, device_blocks=1)  # block 1's state on the device
    for bad in [plan.replace(streamed_updates=(1,)), plan.replace(streamed_updates=(99,))]:
        with pytest.raises(ValueError, match="streamed_updates"):
            compiled(model, bad)


@pytest.mark.parametrize("keep", [(1,), ()])
def test_a_twin_keeping_some_streamed_updates_trains_exactly_and_is_predicted_afresh(keep):
    """replay.twin (register.py --twin-of): the plan's other streamed layers go back to the CPU, every other
    decision stays, its step is the simulator's for the twin, the edit is credited as such, and the twin
    trains as torch.optim.AdamW does. A layer the plan does not stream, or a plan with early updates, has none."""
    from slidedp.scheduler.replay import replay, twin

    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    plan = streamed_plan(model, 2)
    assert plan.streamed_updates == (0, 1)
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)
    other = twin(plan, graph, streamed_updates=keep, why="edited (test)")
    assert other.streamed_updates == keep
    assert other.decisions == plan.decisions and other.device_state == plan.device_state
    assert other.window == plan.window and other.window_loads == plan.window_loads
    assert other.predicted_step_time_s == pytest.approx(replay(other, graph).step_s)
    assert other.predicted_step_time_s != pytest.approx(plan.predicted_step_time_s)
    assert other.solver["searches"]["streamed updates"] == "edited (test)"
    assert "streamed updates edited" in other.solver["chosen_by"] and "edited (test)" in other.summary()
    assert ("streamed updates" in " ".join(other.notes)) == bool(keep)
    with compiled(model, other) as engine:
        assert (engine.runner.streamed.order if keep else engine.runner.streamed) == (list(keep) or None)
        assert set(engine.runner.updates.order) >= set(plan.streamed_updates) - set(keep)  # those on the CPU
        train_side_by_side(engine, ref, steps=3, seed=7, clip=CLIP)
    with pytest.raises(ValueError, match="not among the plan's streamed updates"):
        twin(plan, graph, streamed_updates=(2,), why="x")
    with pytest.raises(ValueError, match="early updates"):
        twin(plan.replace(early_order=(2,)), graph, streamed_updates=(), why="x")
