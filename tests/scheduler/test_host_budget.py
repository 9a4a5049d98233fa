"""Host RAM is a budget like device memory: plan(host_memory=) bounds everything the plan takes of it
(host state as laid out, spare state, offloaded activations, pinned buffers), refuses below the least
any plan takes (min_host_bytes, with the device minimum), and keeps optimizer state on the device
where that is what fits (one rank)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import slidedp
from slidedp.backend.state.host_state import plan_layout
from slidedp.costmodel import memory as mem
from slidedp.ir.build import build_layer_graph
from tests.models import make_model

KW = dict(batch_size=16, seq_len=4096, hardware="h200-sxm")


def _meta_model():
    cfg = Qwen3Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, vocab_size=8192,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_the_host_budget_moves_optimizer_state_to_the_device_and_binds():
    """(Delivery copies always kept here: making one on load is the other way to fit, tested below.)"""
    from slidedp.scheduler.decisions import SolverOptions

    model = _meta_model()
    kw = dict(KW, solver_options=SolverOptions(host_copies=("kept",)))
    free = slidedp.plan(model, "60GiB", **kw)
    assert free.peak_host_bytes == sum(free.host_memory.values()) and free.solver.get("host_budget_bytes") is None
    tight = slidedp.plan(model, "60GiB", host_memory=free.peak_host_bytes - 1, **kw)
    assert tight.peak_host_bytes <= free.peak_host_bytes - 1
    assert set(tight.device_state) > set(free.device_state)  # more state on the device: a lean host layout
    assert tight.host_memory["state"] < free.host_memory["state"]
    line = next(x for x in tight.summary().splitlines() if "host memory" in x)
    params = sum(d.numel for d in tight.decisions)
    assert f"{tight.peak_host_bytes / params:.2f} B per parameter" in line
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        slidedp.plan(model, "60GiB", host_memory=10 << 20, **kw)
    err = info.value
    assert err.min_host_bytes > 10 << 20 and err.host_budget_bytes == 10 << 20
    assert str(err.min_host_bytes) in str(err) and str(err.min_budget_bytes) in str(err)
    at_min = slidedp.plan(model, "60GiB", host_memory=err.min_host_bytes, **kw)  # achievable
    assert at_min.peak_host_bytes <= err.min_host_bytes
    with pytest.raises(slidedp.InfeasibleBudgetError):
        slidedp.plan(model, "60GiB", host_memory=err.min_host_bytes - 1, **kw)


def test_a_tight_host_budget_makes_delivery_copies_on_load():
    """Host RAM a byte short of the plan with every copy kept: CP-SAT makes some copies on load (2 B
    per parameter less each), credits itself with them, and the plan says so; the least host RAM any
    plan needs is that with every copy made on load, and planning there makes them all on load."""
    from slidedp.scheduler.decisions import SolverOptions
    from slidedp.scheduler.plan import Plan

    model = _meta_model()
    kw = dict(KW, solver_options=SolverOptions(device_state_blocks=0))  # the host holds every layer
    free = slidedp.plan(model, "60GiB", **kw)
    assert free.copies_made_on_load() == ()
    tight = slidedp.plan(model, "60GiB", host_memory=free.peak_host_bytes - 1, **kw)
    made = tight.copies_made_on_load()
    assert made and tight.peak_host_bytes <= free.peak_host_bytes - 1
    copies = {d.layer_id: mem.host_copy_bytes(d.numel, 2) for d in tight.decisions}
    assert free.host_memory["state"] - tight.host_memory["state"] == sum(copies[i] for i in made)
    # a decision of the one model (credited to CP-SAT, or to the heuristic it could not beat)
    assert "window, chunks, activations, routes, update owners, delivery copies" in tight.solver["searches"]
    assert "delivery copies made on load" in tight.summary()
    assert any(a.decision == "delivery copies" for a in tight.alternatives)
    again = Plan.from_dict(tight.to_dict())
    again.validate()
    assert again.copies_made_on_load() == made
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        slidedp.plan(model, "60GiB", host_memory=10 << 20, **kw)
    with pytest.raises(slidedp.InfeasibleBudgetError) as kept_only:
        slidedp.plan(model, "60GiB", host_memory=10 << 20, **dict(KW, solver_options=SolverOptions(
            device_state_blocks=0, host_copies=("kept",))))
    assert kept_only.value.min_host_bytes - info.value.min_host_bytes == sum(copies.values())
    leanest = slidedp.plan(model, "60GiB", host_memory=info.value.min_host_bytes, **kw)
    assert set(leanest.copies_made_on_load()) == set(copies)


def test_without_device_state_the_host_state_must_fit_whole():
    """The CPU profile (no device state): min_host_bytes is the whole
    host state plus the pinned buffers, and planning at it succeeds."""
    model = make_model("llama")
    kw = dict(batch_size=2, seq_len=16, precision="fp32", device="cpu")
    with pytest.raises(slidedp.InfeasibleBudgetError, match="host budget") as info:
        slidedp.plan(model, "1GiB", host_memory=1 << 16, **kw)
    plan = slidedp.plan(model, "1GiB", host_memory=info.value.min_host_bytes, **kw)
    assert plan.device_state == () and plan.peak_host_bytes <= info.value.min_host_bytes


def test_one_host_byte_count():
    """The host state's layout allocates exactly what costmodel.memory counts (the planner's and the
    preflight's figure), lean and spare layers included."""
    graph = build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.bfloat16)
    numels = [layer.numel for layer in graph.layers]
    for lean, spare in (((), ()), ((0, 2), (1, 3)), ((), tuple(range(len(numels))))):
        total = plan_layout(graph, delivery_bf16=True, grad_dtype="bfloat16", control_ints=9, spare_layers=spare,
                            lean_layers=lean)[2]
        assert total == mem.host_state_bytes(numels, 2, lean=lean, spare=spare, control_ints=9)
    assert mem.host_layer_bytes(1 << 20, 2) == 16 << 20 and mem.host_layer_bytes(1 << 20, 2, lean=True) == 0


def test_device_state_takes_no_host_bytes_on_one_rank():
    """A host budget below the plan without device state: planned with state on the device, whose
    layers count 0 host bytes (plus the bounded load staging); min_host_bytes is what the leanest
    plan takes with nothing of its device layers on the host, below the old count (6 B per parameter
    for those layers: master and delivery copy)."""
    from slidedp.scheduler.decisions import SolverOptions

    model = _meta_model()
    none = slidedp.plan(model, "60GiB", solver_options=SolverOptions(device_state_blocks=0), **KW)
    assert none.device_state == () and none.host_memory["load_staging"] == 0
    with pytest.raises(slidedp.InfeasibleBudgetError):
        slidedp.plan(model, "60GiB", host_memory=none.peak_host_bytes // 2,
                     solver_options=SolverOptions(device_state_blocks=0), **KW)
    plan = slidedp.plan(model, "60GiB", host_memory=none.peak_host_bytes // 2, **KW)
    assert plan.peak_host_bytes <= none.peak_host_bytes // 2 < none.peak_host_bytes
    numels = [d.numel for d in plan.decisions]
    flags = mem.step_flag_ints(1, len(numels))
    assert plan.host_memory["state"] == mem.host_state_bytes(numels, 2, lean=plan.device_state, control_ints=flags) \
        == sum(mem.host_layer_bytes(n, 2) for i, n in enumerate(numels) if i not in plan.device_state) \
        + mem._page(flags * 8)
    assert plan.host_memory["load_staging"] == mem.LOAD_STAGING_BYTES
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        slidedp.plan(model, "60GiB", host_memory=1 << 20, **KW)
    least = slidedp.plan(model, "60GiB", host_memory=info.value.min_host_bytes, **KW)
    old_count = info.value.min_host_bytes - mem.LOAD_STAGING_BYTES + sum(
        mem.host_layer_bytes(numels[i], 2) * 6 // 16 for i in least.device_state)
    assert least.device_state and info.value.min_host_bytes < old_count
    assert least.host_memory["state"] == mem.host_state_bytes(numels, 2, lean=least.device_state, control_ints=flags)
