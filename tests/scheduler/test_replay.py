"""A saved plan's decisions simulated again (scheduler/replay.py, slidedp.predict): under the hardware the
plan was solved for, the plan's own prediction, for every kind of decision a plan holds; under another
profile, what that profile predicts for the same decisions."""

import dataclasses
import re

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import slidedp
from slidedp.costmodel.hardware import PRESETS

GiB = 2**30


def qwen3(blocks=8, hidden=512, vocab=32768, tied=False):
    with torch.device("meta"):
        return Qwen3ForCausalLM(Qwen3Config(
            hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=blocks, num_attention_heads=8,
            num_key_value_heads=4, head_dim=hidden // 8, vocab_size=vocab, tie_word_embeddings=tied,
            max_position_embeddings=4096)).to(torch.bfloat16)


def features(plan):
    s = plan.schedule
    return {name for name, present in [
        ("early updates", bool(s.early_order)), ("streamed updates", bool(s.streamed_updates)),
        ("early updates in place", s.early_in_place),
        ("device state", bool(s.device_state)), ("streamed gradients", s.streamed_gradients),
        ("streamed vocabulary", any(d.activation == "streamed" for d in s.decisions)),
        ("copies on load", any(d.host_copy == "on_load" for d in s.decisions)),
        ("several ranks", plan.workload.world_size > 1), ("several hosts", plan.workload.hosts > 1),
        ("sharded", any(d.delivery == "sharded" for d in s.decisions)),
        ("offloaded", any(d.activation in ("offload", "recompute_offload") for d in s.decisions)),
    ] if present}


CPU_BOUND = slidedp.SolverOptions(streamed_layers=0, device_state_blocks=0, device_state_prologue=False)
LONG = dict(hidden=1024, seq_len=4096, micro_batches=4)  # compute about the CPU's AdamW: early updates pay
CASES = {
    "boundary, clipping": dict(budget="2GiB", max_grad_norm=1.0),
    "host budget": dict(budget="1GiB", max_grad_norm=1.0, host_memory="2.7GiB", hidden=1024, seq_len=256),
    "early updates": dict(budget="4GiB", max_grad_norm=None, solver_options=CPU_BOUND, **LONG),
    "streamed gradients": dict(budget="4GiB", max_grad_norm=None, nonfinite="stop", solver_options=CPU_BOUND, **LONG),
    "streamed updates": dict(budget="1GiB", max_grad_norm=None, hidden=1024, seq_len=256),
    "early updates in place": dict(budget="1GiB", max_grad_norm=None, nonfinite="stop", hidden=1024, seq_len=256),
    "two ranks": dict(budget="2GiB", max_grad_norm=1.0, world_size=2),
    "two hosts": dict(budget="2GiB", max_grad_norm=1.0, world_size=4, hosts=2, link="ib-4x400"),
    "tied table": dict(budget="2GiB", max_grad_norm=1.0, tied=True, vocab=131072),  # offloads block inputs
}


@pytest.fixture(scope="module")
def plans():
    out = {}
    for name, kw in CASES.items():
        kw = {"seq_len": 2048, "micro_batches": 2, **kw}
        model = qwen3(hidden=kw.pop("hidden", 512), tied=kw.pop("tied", False), vocab=kw.pop("vocab", 32768))
        plan = slidedp.plan(model, kw.pop("budget"), batch_size=1, precision="bf16", hardware="h200-sxm", **kw)
        out[name] = (model, plan)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_replayed_under_its_own_hardware_predicts_its_own_step(plans, case):
    model, plan = plans[case]
    assert slidedp.predict(model, plan) == pytest.approx(plan.predicted_step_time_s, rel=1e-9)


def test_the_cases_cover_every_kind_of_decision(plans):
    covered = set().union(*(features(plan) for _, plan in plans.values()))
    assert covered >= {"early updates", "early updates in place", "streamed updates", "device state",
                       "streamed gradients", "streamed vocabulary", "copies on load", "several ranks", "several hosts",
                       "offloaded"}, covered


def test_another_profile_predicts_the_same_decisions_its_own_way(plans, tmp_path):
    model, plan = plans["early updates"]
    h200 = PRESETS["h200-sxm"]
    slower = dataclasses.replace(h200, cpu_adamw_params_per_s=h200.cpu_adamw_params_per_s / 4)
    assert slidedp.predict(model, plan, hardware=slower) > plan.predicted_step_time_s
    path = tmp_path / "plan.json"
    plan.save(path)
    assert slidedp.predict(model, path, hardware="h200-sxm") == pytest.approx(plan.predicted_step_time_s, rel=1e-9)


def test_a_plan_of_another_model_is_refused(plans):
    _, plan = plans["boundary, clipping"]
    with pytest.raises(ValueError, match="not the plan's model"):
        slidedp.predict(qwen3(blocks=6), plan)


def test_each_plans_gap_is_explained_by_where_its_bound_comes_from(plans):
    """A proven plan says so; an unproven one gives its bound and the one reason for it: CP-SAT stopped short
    in a window (named with its status), a window it did not search, or the analytical floor (where the plan
    takes early or streamed updates, which CP-SAT's model does not hold)."""
    causes = set()
    for name, (_, plan) in plans.items():
        sv, words = plan.solver, plan.solver["gap_explained"]
        assert f"solver's bound: {words}" in plan.summary(), name
        assert (sv["status"] == "OPTIMAL") == words.startswith("optimal"), name
        if sv["status"] == "OPTIMAL":
            continue
        assert f"no decisions step faster than {sv['best_bound_s'] * 1e3:.4g} ms" in words, name
        stopped = re.search(r"CP-SAT stopped in window (\d+) \((\w+)\)", words)
        cause = ["analytical floor, " in words and "does not hold the" in words, bool(stopped),
                 "was not searched by CP-SAT" in words]
        assert sum(cause) == 1, (name, words)
        if cause[0]:
            assert sv["best_bound_s"] == sv["lower_bound_s"], name
        if stopped:
            window = next(w for w in sv["windows"] if w["window"] == int(stopped[1]))
            assert window["status"] == stopped[2] in ("FEASIBLE", "UNKNOWN") and window["best_bound_s"] <= sv["best_bound_s"]
        causes.add(cause.index(True))
    assert causes == {0, 1}  # the cases hold both (no window goes unsearched in models this small)


def test_a_swept_vocabulary_choice_gives_the_lowest_bound_of_every_choice():
    """Where each choice of streamed tables is solved in full (a tied table whose gradient could otherwise
    stream into the update), the plan's bound is the lowest of the choices' bounds, each solved alone."""
    kw = dict(batch_size=1, precision="bf16", hardware="h200-sxm", seq_len=2048, micro_batches=2,
              max_grad_norm=None, nonfinite="stop")
    model = qwen3(tied=True, vocab=131072)
    plan = slidedp.plan(model, "2GiB", **kw)
    assert len(plan.solver["vocab_streamed_tried"]) == 2
    alone = [slidedp.plan(model, "2GiB", solver_options=slidedp.SolverOptions(vocab_streamed=names), **kw)
             for names in ((), ("prologue", "epilogue"))]
    assert plan.solver["best_bound_s"] == pytest.approx(min(p.solver["best_bound_s"] for p in alone), rel=1e-6)
    assert plan.solver["best_bound_s"] <= plan.predicted_step_time_s
