"""The default plan: JSON round trip, reuse, refusal of a plan for something else, memory model."""

import json

import pytest
import torch

import slidedp
from slidedp.scheduler.plan import Plan
from tests.models import VOCAB, make_model


def test_plan_round_trips_and_is_reused(tmp_path):
    model = make_model("qwen3")
    plan = slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert "predicted step" in plan.summary() and "recompute" in plan.summary()
    assert plan.predicted_step_time_s > 0 and plan.peak_device_bytes <= 2**30
    assert loaded.summary() == plan.summary()
    engine = slidedp.compile(model, "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu", plan=path)
    assert engine.plan == plan
    engine.step(torch.randint(0, VOCAB, (2, 16)))
    engine.close()


def test_the_schedule_alone_is_the_contract(tmp_path):
    """A plan saved without its explanation is small, and compile runs it exactly as the whole plan."""
    model = make_model("llama")
    plan = slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    whole, schedule = tmp_path / "plan.json", tmp_path / "schedule.json"
    plan.save(whole)
    plan.save(schedule, explanation=False)
    assert schedule.stat().st_size < whole.stat().st_size / 2
    alone = Plan.load(schedule)
    assert alone.schedule == plan.schedule and alone.timeline == () and "not known" in alone.summary()
    batch = torch.randint(0, VOCAB, (2, 16))
    losses = []
    for p in (whole, schedule):
        engine = slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, precision="fp32",
                                 device="cpu", plan=p)
        losses.append([engine.step(batch) for _ in range(2)])
        engine.close()
    assert losses[0] == losses[1]


def test_a_round_trip_keeps_every_field_in_order(tmp_path):
    plan = slidedp.plan(make_model("qwen3"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    shuffled = plan.replace(memory=dict(reversed(list(plan.memory.items()))))
    shuffled.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == shuffled and again.summary() == shuffled.summary()
    assert list(again.memory) == list(shuffled.memory)


@pytest.mark.parametrize("change, words", [
    (dict(seq_len=32), "seq_len"),
    (dict(batch_size=1), "batch_size"),
    (dict(precision="bf16"), "precision"),
])
def test_plan_for_another_workload_is_refused(tmp_path, change, words):
    model = make_model("llama")
    path = tmp_path / "plan.json"
    slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu").save(path)
    kwargs = dict(batch_size=2, seq_len=16, precision="fp32", device="cpu")
    kwargs.update(change)
    with pytest.raises(ValueError, match="another workload"):
        slidedp.compile(model, "1GiB", plan=str(path), **kwargs)


def test_plan_for_another_model_or_schema_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    slidedp.plan(make_model("llama"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu").save(path)
    with pytest.raises(ValueError, match="fingerprint"):
        slidedp.compile(make_model("gpt2"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu",
                        plan=path)
    data = json.loads(path.read_text())
    data["schema_version"] = 999
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema version"):
        Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a plan"):
        Plan.load(path)


def test_meta_model_plans_without_allocating_and_larger_budget_is_never_slower():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        # Qwen3-8B's layer widths with a third of its blocks: the planning is as for the whole model, faster
        model = Qwen3ForCausalLM(Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=12,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                             vocab_size=151936))
    small = slidedp.plan(model, "12GiB", batch_size=1, seq_len=4096, hardware="h100-sxm")
    large = slidedp.plan(model, "30GiB", batch_size=1, seq_len=4096, hardware="h100-sxm")
    assert small.peak_device_bytes <= 12 * 2**30 and large.peak_device_bytes <= 30 * 2**30
    assert large.predicted_step_time_s <= small.predicted_step_time_s
    with pytest.raises(slidedp.UnsupportedModelError, match="meta device"):
        slidedp.compile(model, "60GiB", batch_size=1, seq_len=4096, device="cpu")


def test_default_plan_is_the_fixed_baseline_and_refuses_too_small_a_budget():
    from slidedp.costmodel.hardware import PRESETS
    from slidedp.ir.build import build_layer_graph
    from slidedp.scheduler.solve import default_plan

    graph = build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.float32)
    kwargs = dict(hardware=PRESETS["cpu"], world_size=1, precision="fp32", micro_batches=1, version="0")
    plan = default_plan(graph, budget_bytes=2**30, **kwargs)
    assert plan.solver["method"] == "default" and plan.window == 2 and plan.timeline
    assert all(d.chunks == 1 and d.activation == ("recompute" if d.kind == "block" else "resident")
               for d in plan.decisions)
    solved = slidedp.plan(make_model("llama"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    assert solved.predicted_step_time_s <= plan.predicted_step_time_s
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        default_plan(graph, budget_bytes=1000, **kwargs)
    assert info.value.min_budget_bytes > 1000


def test_unknown_hardware_is_refused_naming_the_presets(tmp_path, capsys):
    from slidedp.cli import main

    model = make_model("llama")
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu-v5'.*h100-sxm"):
        slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, hardware="tpu-v5")
    with pytest.raises(TypeError, match="hardware must be"):
        slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, hardware=3.5)
    assert main(["plan", "llama-tiny", "--budget", "1GiB", "--batch-size", "1", "--seq-len", "16",
                 "--hardware", "tpu-v5", "--out", str(tmp_path / "p.json")]) == 2
    assert not (tmp_path / "p.json").exists()
    assert "unknown hardware 'tpu-v5'" in capsys.readouterr().err


def test_alternatives_keep_the_rest_of_the_plan(monkeypatch):
    """Each "why" line sets the plan itself against the plan with one decision changed: the chosen
    side is the plan's predicted step, and the runner-up keeps its streamed updates, early updates
    and device-resident state (simulated by the same oracle, not a closed form without them)."""
    from dataclasses import replace

    from slidedp.costmodel.hardware import PRESETS
    from slidedp.ir.build import build_layer_graph
    from slidedp.scheduler import explain
    from slidedp.scheduler.decisions import Problem, SolverOptions
    from slidedp.scheduler.oracles.timeline import simulate
    from slidedp.scheduler.problem.costs import ProblemCosts
    from slidedp.scheduler.solve import solve, solve_plan

    graph = build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.float32)
    options = SolverOptions(streamed_layers=2, device_state_blocks=0)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["cpu"], precision="fp32", micro_batches=2,
                      streamed_updates=True, options=options)
    assert len(plan.streamed_updates) == 2 and plan.alternatives
    tick = plan.solver["tick_s"]
    for a in plan.alternatives:
        assert abs(a.chosen_step_s - plan.predicted_step_time_s) <= tick, a

    costs = ProblemCosts(Problem(graph, PRESETS["cpu"], 1, 2, streamed_updates=True), options)
    d = solve(costs, 2**30).decisions
    assert d.streamed
    seen = []

    def spy(c, other, **kw):
        seen.append(other)
        return simulate(c, other, **kw)

    monkeypatch.setattr(explain, "simulate", spy)
    sim = simulate(costs, d, record=True)
    alts = explain.alternatives(costs, d, sim, 2**30)
    assert seen and all(abs(a.chosen_step_s - sim.step_s) <= tick for a in alts)
    for other in seen:  # one decision changed, everything else the plan's own
        assert (other.streamed, other.early_order) == (d.streamed, d.early_order)
        changed = {"window"} if other.window != d.window else set()
        changed |= {"update_order"} if other.update_order != d.update_order else set()
        for mine, theirs in zip(d.layers, other.layers):
            changed |= {f for f in ("chunks", "activation", "delivery", "reduction")
                        if getattr(mine, f) != getattr(theirs, f)}
        assert len(changed) == 1, changed
    window = next(a for a in alts if a.decision == "window")
    w = int(window.runner_up.split()[-1])
    assert window.runner_up_step_s == pytest.approx(
        simulate(costs, replace(d, window=w), all_ranks=False).step_s)


@pytest.mark.parametrize("tied", [False, True])
def test_the_prologues_embedding_backward_is_in_the_plans_peak(tied):
    """The prologue's backward makes its embedding table's fp32 weight gradient from every micro-batch's
    lookups (backend/runtime/embedding_grads.py): the plan's peak holds that beside the resident layers,
    and the lowered program allocates it there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slidedp import api
    from slidedp.backend.lowering.verify import verify_program
    from slidedp.costmodel import memory as mem

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=tied))
    plan = slidedp.plan(model, "1GiB", batch_size=2, seq_len=256, micro_batches=4, precision="fp32", device="cpu")
    graph = api.plan_graph(model, plan)
    embedding = mem.prologue_backward_bytes(graph.prologue.params, 4, 2 * 256)
    assert embedding >= 4 * 2 * 256 * 64 * 4  # the lookups' output gradients in fp32, at least
    resident = sum(mem.resident_layer_bytes(graph.edge_resident_numel(()), 4))
    prologue_backward = plan.explanation.memory_timeline[-1]  # the pass's last compute
    assert prologue_backward.device_bytes >= resident + embedding
    assert verify_program(api.lower_plan(graph, plan)).peak_device_bytes <= plan.peak_device_bytes


def test_a_plan_with_device_state_holds_its_updates_fp32_piece():
    """The device-state update copies one piece of a layer's gradient to fp32 at a time
    (backend/state/device_state.py): a plan that keeps optimizer state on the device charges that piece
    once beside the layers' state, and the lowered program holds it."""
    from slidedp import api
    from slidedp.backend.lowering.verify import verify_program
    from slidedp.costmodel import memory as mem
    from tests.scheduler.test_replay import qwen3

    model = qwen3()
    plan = slidedp.plan(model, "2GiB", batch_size=1, seq_len=2048, micro_batches=2, precision="bf16",
                        hardware="h200-sxm", max_grad_norm=1.0)
    assert plan.device_state, "the case must keep some optimizer state on the device"
    graph = api.plan_graph(model, plan)
    layers = sum(mem.device_state_bytes(graph.layers[i].numel, 2) for i in plan.device_state)
    piece = plan.memory["device_state_bytes"] - layers  # at least what the largest kept layer's update copies
    largest = max(graph.layers[i].numel for i in plan.device_state)
    assert 4 * min(mem.DEVICE_STATE_PIECE_NUMEL, largest) <= piece <= 4 * mem.DEVICE_STATE_PIECE_NUMEL
    assert mem.device_update_piece_bytes([]) == 0 and mem.device_update_piece_bytes([10, 3]) == 40
    assert verify_program(api.lower_plan(graph, plan)).peak_device_bytes <= plan.peak_device_bytes
