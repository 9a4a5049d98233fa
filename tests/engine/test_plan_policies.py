"""The executor follows the plan: keep / offload / recompute per block, chunked copies, row-chunked
loss, window 1..3 — and stays exact against torch.optim.AdamW (CPU, fp32)."""

import copy
import dataclasses

import pytest

import slidedp
from slidedp.scheduler.problem.lanes import window_loads
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side
from tests.models import make_model


def edited_plan(model, *, activations, chunks, window, loss_chunk_tokens=None, compile_blocks=None):
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu",
                        micro_batches=2, compile_blocks=compile_blocks)
    policies = iter(activations)
    decisions = tuple(
        dataclasses.replace(d, chunks=chunks, activation=next(policies) if d.kind == "block" else d.activation,
                            owners=())  # owners: one per chunk, or none (rank 0)
        for d in plan.decisions
    )
    n_blocks = sum(d.kind == "block" for d in decisions)
    fields = dict(decisions=decisions, window=window, window_loads=window_loads(n_blocks, window))
    if loss_chunk_tokens is not None:
        fields["loss_chunk_tokens"] = loss_chunk_tokens
    return plan.replace(**fields)


@pytest.mark.parametrize("family, tied, activations, chunks, window", [
    ("llama", False, ["keep", "offload", "recompute"], 3, 1),
    ("gpt2", True, ["offload", "keep", "keep"], 2, 2),
    ("qwen3", False, ["keep", "keep", "keep"], 1, 3),
    ("plain", True, ["recompute", "offload", "keep"], 4, 2),
])
def test_policies_are_exact(family, tied, activations, chunks, window):
    model = make_model(family, tied=tied)
    ref = copy.deepcopy(model).eval()
    plan = edited_plan(model, activations=activations, chunks=chunks, window=window, loss_chunk_tokens=SEQ)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, plan=plan)
    assert engine.executor.activation == activations and engine.executor.window == window
    engine.executor.min_offload_bytes = 0  # tiny model: offload every saved activation
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=5)
        assert (engine.executor.offloaded_bytes > 0) == ("offload" in activations)
        assert (engine.executor.arena.used > 0) == ("offload" in activations)  # offloaded into the arena
        # every offloaded activation came back by the program's h2d_saved op, ahead of its backward
        assert engine.executor.block_runner.late_reload_bytes == 0


def test_unknown_policy_is_refused():
    model = make_model("llama")
    plan = edited_plan(model, activations=["keep", "swap", "keep"], chunks=1, window=2)
    with pytest.raises(ValueError, match="activation policy"):
        slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", plan=plan)


def test_compiled_blocks_are_exact_and_compile_once():
    """compile_blocks: every block runs through torch.compile (here inductor on the CPU), one graph
    per grad mode for all blocks whatever their policy (kept and offloaded blocks' saved-tensor
    hooks act on the compiled graph's saved tensors), and training stays exact against
    torch.optim.AdamW."""
    import torch._dynamo

    model = make_model("qwen3")
    ref = copy.deepcopy(model).eval()
    plan = edited_plan(model, activations=["recompute", "keep", "offload"], chunks=1, window=2,
                       compile_blocks=True)
    assert plan.workload.compiled_blocks and "blocks compiled" in plan.summary()
    with pytest.raises(ValueError, match="compile_blocks is True in the plan but False here"):
        slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", plan=plan,
                        compile_blocks=False)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, plan=plan)
    assert engine.executor.compile_blocks  # the plan's choice
    engine.executor.min_offload_bytes = 0  # tiny model: offload every saved activation
    torch._dynamo.utils.counters.clear()
    with engine:
        train_side_by_side(engine, ref, steps=2, seed=7)
        assert engine.executor.offloaded_bytes > 0
    stats = torch._dynamo.utils.counters["stats"]
    # forward without autograd and recompute with it: two graphs, whatever the number of blocks and steps
    assert stats["unique_graphs"] == 2, dict(stats)
    assert not torch._dynamo.utils.counters["recompiles"], dict(torch._dynamo.utils.counters["recompiles"])


def test_compile_blocks_defaults_off_on_the_cpu_and_on_for_gpu_plans():
    model = make_model("llama")
    with slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32") as engine:
        assert not engine.executor.compile_blocks and not engine.plan.workload.compiled_blocks
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, hardware="h200-sxm")
    assert plan.workload.compiled_blocks
    with pytest.raises(TypeError, match="compile_blocks"):
        slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, compile_blocks="yes")


def test_a_plan_for_another_machine_is_bounded_by_its_host_memory(monkeypatch):
    """plan(host_memory=) passes that machine's host RAM to the solver as a hard constraint on all the
    plan takes of it (host state, spare state, offloaded activations, pinned buffers), as compile
    passes what this one has available less the preflight's headroom. Without it planning is
    unbounded; below the least any plan takes it is refused with both numbers."""
    from slidedp import api
    from slidedp.run import preflight

    seen = []

    def spy(graph, **kwargs):
        seen.append((kwargs["host_budget_bytes"], kwargs["early_host_bytes"]))
        return real(graph, **kwargs)

    real = api.solve_plan
    monkeypatch.setattr(api, "solve_plan", spy)
    model = make_model("llama")
    kwargs = dict(batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu")
    free = slidedp.plan(model, "1GiB", **kwargs)
    assert seen[-1] == (None, 1 << 62)  # max_grad_norm None on one rank: early updates allowed
    assert free.peak_host_bytes == sum(free.host_memory.values()) > 0
    plan = slidedp.plan(model, "1GiB", host_memory="3GiB", **kwargs)
    assert seen[-1] == (3 << 30, 1 << 62) and plan.peak_host_bytes <= 3 << 30
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:  # too little: not even the host state fits
        slidedp.plan(model, "1GiB", host_memory=1 << 16, **kwargs)
    err = info.value
    assert err.min_host_bytes > 1 << 16 and str(err.min_host_bytes) in str(err) and str(err.min_budget_bytes) in str(err)
    assert slidedp.plan(model, "1GiB", host_memory=err.min_host_bytes, **kwargs).peak_host_bytes <= err.min_host_bytes
    with pytest.raises(ValueError, match="host_memory"):
        slidedp.plan(model, "1GiB", host_memory="lots", **kwargs)
    monkeypatch.setattr(api, "host_available_bytes", lambda: 5 << 30)
    request = api.check_request(model, "1GiB", world_size=1, device="cpu", precision="fp32", optimizer=None,
                                max_grad_norm=None, hardware=None, micro_batches=1, compile_blocks=None,
                                batch_size=BATCH, seq_len=SEQ)
    assert api.host_budget(request) == (5 << 30) - preflight.HOST_HEADROOM_BYTES  # compile: available less headroom


def test_compile_options_are_the_keyword_arguments_as_one_value():
    """options=CompileOptions(...) plans and trains as the same keyword arguments do; both at once, or
    neither, is refused naming them."""
    import torch

    from tests.models import VOCAB

    kwargs = dict(batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu", max_grad_norm=CLIP,
                  optimizer=slidedp.AdamW(lr=LR, weight_decay=WD))
    options = slidedp.CompileOptions(**kwargs)
    by_kwargs = slidedp.plan(make_model("llama"), "1GiB", **kwargs)
    by_options = slidedp.plan(make_model("llama"), "1GiB", options=options)
    assert by_options.schedule == by_kwargs.schedule and by_options.workload == by_kwargs.workload
    batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    losses = []
    for how in (dict(options=options), kwargs):
        engine = slidedp.compile(make_model("llama"), "1GiB", **how)
        losses.append([engine.step(batch) for _ in range(2)])
        engine.close()
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="seq_len given beside options"):
        slidedp.plan(make_model("llama"), "1GiB", seq_len=SEQ, options=options)
    with pytest.raises(ValueError, match="precision"):
        slidedp.compile(make_model("llama"), "1GiB", precision="fp32", options=options)
    with pytest.raises(TypeError, match="batch_size and seq_len must be given"):
        slidedp.plan(make_model("llama"), "1GiB")
    with pytest.raises(TypeError, match="CompileOptions"):
        slidedp.plan(make_model("llama"), "1GiB", options=dict(kwargs))
