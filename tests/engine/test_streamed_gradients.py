"""Streamed gradients (plan.streamed_gradients: one rank, no clipping, one pass, nonfinite="stop"):
each piece of a host layer's gradient updates the layer in place from the staging buffer it lands in,
and the host keeps no gradient. The training is that of the same plan updated after the backward,
bit for bit, and torch.optim.AdamW's; the planner streams them where the host budget needs it; a
non-finite gradient stops training with the state named as part-applied, until a checkpoint loads."""

import copy

import pytest
import torch

import slidedp
from slidedp.costmodel import memory as mem
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.search.early_order import landing_order
from tests.engine.test_early_updates import stops_part_applied, train_beside_late
from tests.engine.test_host_copies import layouts_agree_and_checkpoints_cross
from tests.engine.test_exactness import BATCH, LR, SEQ, WD, random_batch, reference_loss
from tests.models import VOCAB, make_model
from tests.reliability.test_numerical_faults import poison

KW = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", micro_batches=2)
KEPT_COPIES = SolverOptions(host_copies=("kept",))


def streamed_plan(model, **kw):
    """The solved plan of `model` with every host layer's gradient streamed into its update."""
    plan = slidedp.plan(model, "1GiB", **KW, **kw)
    n = len(plan.decisions)
    host = [i for i in landing_order(n) if i not in plan.device_state]
    return plan.replace(early_order=tuple(host), streamed_gradients=True)


def compiled(model, plan, **kw):
    kw = {"nonfinite": "stop", **kw}
    return slidedp.compile(model, "1GiB", **KW, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), plan=plan, **kw)


@pytest.mark.parametrize("family, tied, vocab", [("llama", False, ()), ("gpt2", True, ()),
                                                 ("qwen3", False, ("prologue", "epilogue"))])
def test_streamed_gradients_are_exact(family, tied, vocab):
    """(qwen3: the embedding and head stream by vocabulary chunk, their gradients piece by piece.)"""
    model = make_model(family, tied=tied)
    ref, late_model = copy.deepcopy(model).eval(), copy.deepcopy(model)
    plan = streamed_plan(model, solver_options=SolverOptions(vocab_streamed=vocab, vocab_chunk_numel=1000)
                         if vocab else None)
    assert sum(d.activation == "streamed" for d in plan.decisions) == len(vocab)
    engine = compiled(model, plan)
    late = compiled(late_model, plan.replace(early_order=(), streamed_gradients=False))
    assert all(layer.grad is None and layer.spare is None for layer in engine.host.layers)
    assert engine.runner.early is None and all(layer.grad is not None for layer in late.host.layers)
    numels = [layer.numel for layer in engine.graph.layers]
    assert engine.host.nbytes == mem.host_state_bytes(numels, 4, no_grad=range(len(numels)),
                                                      control_ints=mem.step_flag_ints(1, len(numels)))
    with engine, late:
        train_beside_late(engine, late, ref, steps=3, seed=7)


def test_a_tight_host_budget_streams_the_gradients_and_trains_exactly(tmp_path):
    """Host RAM a byte short of the plan that keeps its gradients: the planner streams them (credited
    to its search), the host state is 4 B per parameter less in fp32, the run equals the kept plan's,
    and a checkpoint of either layout resumes under the other."""
    model = make_model("qwen3")
    kept_plan = slidedp.plan(model, "1GiB", **KW, nonfinite="stop", solver_options=KEPT_COPIES)
    assert not kept_plan.streamed_gradients
    plan = slidedp.plan(model, "1GiB", **KW, nonfinite="stop", solver_options=KEPT_COPIES,
                        host_memory=kept_plan.peak_host_bytes - 1)
    assert plan.streamed_gradients and plan.peak_host_bytes < kept_plan.peak_host_bytes
    assert "gradients streamed into the update" in plan.solver["searches"]
    assert "streamed gradients" in plan.summary()
    again = slidedp.Plan.from_dict(plan.to_dict())
    again.validate()
    assert again == plan
    with pytest.raises(slidedp.InfeasibleBudgetError):  # without nonfinite="stop" the gradients must fit
        slidedp.plan(model, "1GiB", **KW, solver_options=KEPT_COPIES, host_memory=plan.peak_host_bytes)
    gen = torch.Generator().manual_seed(2)
    layouts_agree_and_checkpoints_cross(lambda p: compiled(copy.deepcopy(model), p), plan, kept_plan,
                                        [random_batch(gen, 2 * BATCH) for _ in range(4)], tmp_path)


def test_a_non_finite_gradient_stops_with_the_state_named_part_applied(tmp_path):
    """Block 1's gradient turns non-finite after later layers were updated in place as they landed."""
    switch = {"on": False}
    model = make_model("llama")
    poison(model, "backward", switch)
    stops_part_applied(compiled(model, streamed_plan(model)), switch, tmp_path)


def test_streamed_gradient_plans_need_one_pass_no_clipping_and_stop():
    model = make_model("llama")
    plan = streamed_plan(model)
    with pytest.raises(ValueError, match="nonfinite='stop'"):
        compiled(model, plan, nonfinite="skip")
    with pytest.raises(ValueError, match="max_grad_norm=None"):
        compiled(model, plan, max_grad_norm=1.0)
    with compiled(model, plan) as engine:
        with pytest.raises(ValueError, match="one pass per step"):
            engine.step(torch.randint(0, VOCAB, (4 * BATCH, SEQ)))
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))  # still usable: nothing had run
    bad = plan.replace(early_order=plan.early_order[1:])
    assert any("streamed_gradients" in p for p in bad.problems())


def test_stop_without_streaming_raises_and_changes_nothing():
    """nonfinite="stop" on a plan that keeps its gradients: the step raises, nothing was applied."""
    switch = {"on": False}
    model = make_model("llama")
    poison(model, "forward", switch)
    with compiled(model, streamed_plan(model).replace(early_order=(), streamed_gradients=False)) as engine:
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        switch["on"] = True
        with pytest.raises(slidedp.NonFiniteGradientError, match="nothing was applied"):
            engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())


def test_a_failed_step_with_streamed_gradients_refuses_the_next_until_a_checkpoint(monkeypatch, tmp_path):
    """An error in the backward after some layers were updated in place: the step raises it, the next
    is refused naming the failure, and a checkpoint brings the engine back."""
    model = make_model("llama")
    engine = compiled(model, streamed_plan(model))
    engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    engine.save_checkpoint(tmp_path / "ckpt")
    executor = engine.runner.executor
    real = executor._op_prologue_bwd

    def broken(*args, **kw):
        raise RuntimeError("backward failed")

    monkeypatch.setattr(executor, "_op_prologue_bwd", broken)
    with pytest.raises(RuntimeError, match="backward failed"):
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    monkeypatch.setattr(executor, "_op_prologue_bwd", real)
    with pytest.raises(RuntimeError, match="part-applied; load a checkpoint"):
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    engine.close()


@pytest.mark.parametrize("delivery", ["sharded", pytest.param("replicated", marks=pytest.mark.slow)])
def test_two_ranks_stream_their_own_chunks_exactly(delivery):
    """Two worker ranks, the GPU reduction: each rank applies the chunks it owns as they land and marks
    the layer; the run is the kept-gradient plan's bit for bit and torch.optim.AdamW's."""
    model = make_model("qwen3")
    ref = copy.deepcopy(model).eval()
    options = SolverOptions(deliveries=(delivery,), reductions=("gpu",))
    kw = dict(KW, world_size=2)
    kept_plan = slidedp.plan(model, "1GiB", hardware="h100-sxm", solver_options=options, nonfinite="stop",
                             compile_blocks=False, **kw)  # eager blocks: no compile in each worker
    n = len(kept_plan.decisions)
    plan = kept_plan.replace(early_order=tuple(i for i in landing_order(n) if i not in kept_plan.device_state),
                             streamed_gradients=True)
    assert not kept_plan.streamed_gradients and not plan.problems()
    opt = slidedp.AdamW(lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(4)
    batches = [random_batch(gen, 2 * 2 * BATCH) for _ in range(3)]
    runs = []
    for p in (plan, kept_plan):
        with slidedp.compile(copy.deepcopy(model), "1GiB", plan=p, optimizer=opt, nonfinite="stop", **kw) as engine:
            runs.append(([engine.step(ids, labels) for ids, labels in batches], engine.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(w, runs[1][1][k]) for k, w in runs[0][1].items())
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for (ids, labels), loss in zip(batches, runs[0][0]):
        ref_loss = reference_loss(ref, ids, labels)
        torch_opt.zero_grad()
        ref_loss.backward()
        torch_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(runs[0][1][name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)


def test_the_planner_streams_the_gradients_of_two_ranks_where_the_host_needs_it():
    """Two ranks reduced on the GPUs, host RAM a byte short of the plan that keeps its gradients: the
    plan streams them (simulated with every rank's updates as its chunks land); with the CPU reduction
    it cannot, and the host budget is refused."""
    model = make_model("llama")
    kw = dict(KW, world_size=2, hardware="h100-sxm", nonfinite="stop")
    gpu = SolverOptions(host_copies=("kept",), deliveries=("sharded",), reductions=("gpu",))
    kept = slidedp.plan(model, "1GiB", solver_options=gpu, **kw)
    assert not kept.streamed_gradients
    plan = slidedp.plan(model, "1GiB", solver_options=gpu, host_memory=kept.peak_host_bytes - 1, **kw)
    assert plan.streamed_gradients and plan.peak_host_bytes < kept.peak_host_bytes and not plan.problems()
    cpu = SolverOptions(host_copies=("kept",), deliveries=("replicated",), reductions=("cpu",))
    with pytest.raises(slidedp.InfeasibleBudgetError):
        slidedp.plan(model, "1GiB", solver_options=cpu, host_memory=plan.peak_host_bytes, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finite_check_of_a_landed_piece_agrees_with_torch(dtype):
    """The check each streamed piece passes before its update (all_finite: least and greatest element)
    says what torch.isfinite(t).all() says, for NaN, either infinity, finite extremes and empty pieces."""
    from slidedp.backend.runtime.rank import all_finite

    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    for n in (0, 1, 7, 4097):
        for bad in (None, float("nan"), float("inf"), -float("inf"), big, -big):
            t = torch.randn(n, generator=g).to(dtype)
            if n and bad is not None:
                t[int(torch.randint(n, (1,), generator=g))] = bad
            assert all_finite(t) == bool(torch.isfinite(t).all()), (n, bad, dtype)


def test_a_non_finite_head_gradient_streamed_by_vocabulary_chunk_is_not_applied():
    """The head's gradient lands first, chunk by chunk of the vocabulary, each checked by its sum of squares
    on the device: a non-finite forward (every gradient NaN) applies nothing, and the step stops."""
    switch = {"on": False}
    model = make_model("qwen3")
    poison(model, "forward", switch)
    plan = streamed_plan(model, solver_options=SolverOptions(vocab_streamed=("prologue", "epilogue"),
                                                             vocab_chunk_numel=1000))
    g = torch.Generator().manual_seed(0)
    with compiled(model, plan) as engine:
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g))
        before = [t.clone() for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]
        switch["on"] = True
        with pytest.raises(slidedp.NonFiniteGradientError):
            engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g))
        after = [t for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
