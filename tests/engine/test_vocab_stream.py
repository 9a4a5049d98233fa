"""A vocabulary-streamed embedding and head (docs/design.md §4.14) against torch.optim.AdamW (CPU, fp32):
several chunks, gradient accumulation (micro-batches and passes), clipping over every gradient."""

import copy

import pytest
import torch

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, random_batch, reference_loss, train_side_by_side
from tests.models import FAMILIES, VOCAB, make_model

CHUNK_NUMEL = 7 * 32  # a few rows per chunk: VOCAB rows cut into many chunks, the last one short


def compile_streamed(model, streamed, micro_batches=1, clip=CLIP, budget="1GiB"):
    kw = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", micro_batches=micro_batches,
              optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=clip)
    plan = slidedp.plan(model, budget, solver_options=slidedp.SolverOptions(
        vocab_streamed=streamed, vocab_chunk_numel=CHUNK_NUMEL), **{k: v for k, v in kw.items() if k != "optimizer"})
    return plan, slidedp.compile(model, budget, plan=plan, **kw)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("streamed", [("prologue", "epilogue"), ("epilogue",), ("prologue",)])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_tables_match_torch_adamw(family, streamed, micro_batches):
    model = make_model(family)
    if family == "plain" and "epilogue" in streamed:  # no get_output_embeddings: the loss is not fused
        with pytest.raises(ValueError, match="cannot stream"):
            compile_streamed(model, streamed, micro_batches)
        return
    ref = copy.deepcopy(model).eval()
    plan, engine = compile_streamed(model, streamed, micro_batches)
    edges = {d.kind: d.activation for d in plan.decisions if d.kind != "block"}
    assert edges == {k: "streamed" if k in streamed else "resident" for k in ("prologue", "epilogue")}
    assert plan.vocab_chunk_rows == 7 and -(-VOCAB // 7) > 2
    with engine:
        train_side_by_side(engine, ref, steps=4, seed=3)
        assert engine.last_step.clip_coef < 1.0, "the test must exercise clipping"


def test_streamed_without_clipping_and_several_passes():
    """More rows than one pass holds: passes summed on the host; no clipping (early updates allowed)."""
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    _, engine = compile_streamed(model, ("prologue", "epilogue"), micro_batches=1, clip=None)
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=5, clip=None)


def test_evaluate_with_streamed_tables():
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    _, engine = compile_streamed(model, ("prologue", "epilogue"))
    ids, labels = random_batch(torch.Generator().manual_seed(0), BATCH)
    with engine:
        assert engine.evaluate(ids, labels) == pytest.approx(reference_loss(ref, ids, labels).item(), rel=1e-5)


def test_tied_tables_do_not_stream():
    """A tied embedding and head are one parameter of two layers: never streamed (resident)."""
    model = make_model("llama", tied=True)
    with pytest.raises(ValueError, match="cannot stream"):
        slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu",
                     solver_options=slidedp.SolverOptions(vocab_streamed=("epilogue",)))
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu")
    assert all(d.activation == "resident" for d in plan.decisions if d.kind != "block")
