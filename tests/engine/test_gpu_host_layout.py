"""On a GPU (skipped without one): the host-layout decisions on CUDA. A vocabulary-streamed embedding
and head (tied or not) train like GPU-resident PyTorch; delivery copies made on load (the device casts the fp32
master it receives) and gradients streamed into the update train bit for bit as the same plan with
every copy and gradient kept; the blocks' gradient buffers wait for their slow copies."""

import copy
from dataclasses import replace

import pytest
import torch

import slidedp
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.search.early_order import landing_order
from tests.engine.test_exactness import BATCH, SEQ, random_batch
from tests.engine.test_gpu import LR, train_against_gpu_resident
from tests.models import make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB_STREAMED = SolverOptions(vocab_streamed=("prologue", "epilogue"), vocab_chunk_numel=1000,
                               host_copies=("kept",), device_state_blocks=0)  # every layer's state on the host
KW = dict(batch_size=BATCH, seq_len=SEQ, device="cuda", precision="bf16", micro_batches=2, hardware="h200-sxm")


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_streamed_tables_match_gpu_resident(tied):
    """Untied, or one tied table streamed for both of its uses (its gradient summed on the host)."""
    model = make_model("qwen3", tied=tied)
    ref = copy.deepcopy(model).cuda().eval()
    plan = slidedp.plan(model, "1GiB", max_grad_norm=1.0, solver_options=VOCAB_STREAMED, **KW)
    assert {d.kind: d.activation for d in plan.decisions if d.kind != "block"} == \
        {"prologue": "streamed", "epilogue": "streamed"}
    with slidedp.compile(model, "1GiB", plan=plan, optimizer=slidedp.AdamW(lr=LR), max_grad_norm=1.0,
                         **KW) as engine:
        train_against_gpu_resident(engine, ref)


def train_bit_for_bit(model, reference, other, kw: dict, seed: int, check) -> None:
    """Three steps of a copy of `model` under each plan on the same batches: the same finite losses and
    the same state, bit for bit; `check(engine)` on the engine of `other` first."""
    runs = []
    for plan in (reference, other):
        gen = torch.Generator().manual_seed(seed)
        with slidedp.compile(copy.deepcopy(model), "1GiB", plan=plan, optimizer=slidedp.AdamW(lr=LR), **kw) as e:
            if plan is other:
                check(e)
            losses = [e.step(*random_batch(gen, 2 * BATCH)) for _ in range(3)]
            runs.append((losses, e.state_dict()))
    (losses_ref, state_ref), (losses_other, state_other) = runs
    assert all(torch.isfinite(torch.tensor(losses_ref))) and losses_other == losses_ref
    for name, w in state_ref.items():
        assert torch.equal(state_other[name], w), name


def test_copies_on_load_and_streamed_gradients_equal_the_kept_layout():
    model = make_model("qwen3")
    kw = dict(KW, max_grad_norm=None, nonfinite="stop")
    kept = slidedp.plan(model, "1GiB", solver_options=VOCAB_STREAMED, **kw)
    assert not kept.streamed_gradients and kept.copies_made_on_load() == () and kept.device_state == ()
    host = [i for i in landing_order(len(kept.decisions)) if i not in kept.device_state]
    lean = kept.replace(decisions=tuple(replace(d, host_copy="on_load") for d in kept.decisions),
                        early_order=tuple(host), streamed_gradients=True, early_in_place=False)
    lean.validate()

    def lean_layout(e):
        assert all(layer.grad is None and layer.delivery is None for layer in e.host.layers)

    train_bit_for_bit(model, kept, lean, kw, 4, lean_layout)


def test_early_updates_in_place_equal_the_updates_after_the_backward():
    """nonfinite="stop": every host layer updated in place as its gradient lands (no spare state) trains bit
    for bit as the same plan updated after the backward, on CUDA (its copies and streams)."""
    model = make_model("qwen3")
    kw = dict(KW, max_grad_norm=None, nonfinite="stop")
    solved = slidedp.plan(model, "1GiB", solver_options=VOCAB_STREAMED, **kw)
    host = [i for i in landing_order(len(solved.decisions)) if i not in solved.device_state]
    after = solved.replace(early_order=(), early_in_place=False, streamed_gradients=False, streamed_updates=())
    early = after.replace(early_order=tuple(host), early_in_place=True)
    early.validate()

    def in_place(e):
        assert e.runner.early.in_place and all(layer.spare is None for layer in e.host.layers)

    train_bit_for_bit(model, after, early, kw, 5, in_place)


def test_a_non_finite_streamed_gradient_applies_nothing_on_the_gpu():
    """The finite check of streamed gradients on CUDA (the device's sum of squares, copied down ahead of the
    chunks it covers): a forward gone NaN makes every gradient NaN; the first to land is the head's, so
    nothing is applied, and the step stops."""
    from tests.reliability.test_numerical_faults import poison

    switch = {"on": False}
    model = make_model("qwen3")
    poison(model, "forward", switch)
    kw = dict(KW, max_grad_norm=None, nonfinite="stop", compile_blocks=False)  # eager blocks run the hook
    plan = slidedp.plan(model, "1GiB", solver_options=VOCAB_STREAMED, **kw)
    host = [i for i in landing_order(len(plan.decisions)) if i not in plan.device_state]
    plan = plan.replace(early_order=tuple(host), streamed_gradients=True, early_in_place=False)
    gen = torch.Generator().manual_seed(5)
    with slidedp.compile(model, "1GiB", plan=plan, optimizer=slidedp.AdamW(lr=LR), **kw) as engine:
        engine.step(*random_batch(gen, 2 * BATCH))
        before = [t.clone() for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]
        switch["on"] = True
        with pytest.raises(slidedp.NonFiniteGradientError):
            engine.step(*random_batch(gen, 2 * BATCH))
        after = [t for layer in engine.host.layers for t in (layer.master, layer.exp_avg, layer.exp_avg_sq)]
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_slow_gradient_copies_hold_back_the_backward_that_reuses_their_buffer():
    """The blocks' two gradient buffers are refilled only after their copies to the host (grad_buffers.py):
    with every gradient copy held back on the D2H stream (a sleep queued before it), the backward would
    overwrite a buffer still being copied if it did not wait; the step is bit for bit the step without
    the delay, and the same two buffers serve every block."""
    model = make_model("qwen3")
    kw = dict(KW, max_grad_norm=1.0)
    plan = slidedp.plan(model, "1GiB", solver_options=VOCAB_STREAMED, **kw)
    delayed = plan.replace(early_order=plan.early_order)  # the same plan, run with slow copies
    buffers = set()

    def slow_copies(e):
        routes, take = e.executor.routes, e.executor.block_runner.grads.take
        gradient = routes.gradient

        def held_back(layer_id, acc, sumsq):
            with routes.streams.on("d2h"):
                torch.cuda._sleep(20_000_000)  # about 10 ms of the D2H stream
            return gradient(layer_id, acc, sumsq)

        def noted(layer_id, numel):
            buffer = take(layer_id, numel)
            buffers.add(buffer.data_ptr())
            return buffer

        routes.gradient = held_back
        e.executor.block_runner.grads.take = noted

    train_bit_for_bit(model, plan, delayed, kw, 5, slow_copies)
    assert len(buffers) == 2
