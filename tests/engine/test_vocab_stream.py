"""A vocabulary-streamed embedding and head (docs/design.md §4.14) against torch.optim.AdamW (CPU, fp32):
several chunks, gradient accumulation (micro-batches and passes), clipping over every gradient; a
tied table streamed for both of its uses."""

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


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_tied_table_streams_and_matches_torch_adamw(family, micro_batches):
    """A tied embedding and head, one parameter of two layers, streamed for both: its gradient is the
    head's plus the embedding's, clipped once by the norm of the sum (GPT-2: its position embeddings
    stay resident in the prologue)."""
    model = make_model(family, tied=True)
    ref = copy.deepcopy(model).eval()
    plan, engine = compile_streamed(model, ("prologue", "epilogue"), micro_batches)
    assert {d.activation for d in plan.decisions if d.kind != "block"} == {"streamed"}
    assert not plan.streamed_gradients
    assert "(tied table)" in next(k for k in plan.solver["searches"] if k.startswith("streamed vocabulary"))
    with engine:
        train_side_by_side(engine, ref, steps=4, seed=3)
        assert engine.last_step.clip_coef < 1.0, "the test must exercise clipping"


def test_tied_table_streams_without_clipping_with_early_updates():
    """No clipping, every layer updated as its gradient lands: the prologue's update waits for the
    embedding's part of the tied table's gradient, added on the host to the head's."""
    from tests.engine.test_early_updates import early_plan

    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).eval()
    plan = early_plan(model, micro_batches=2, solver_options=slidedp.SolverOptions(
        vocab_streamed=("prologue", "epilogue"), vocab_chunk_numel=CHUNK_NUMEL))
    assert plan.early_order and {d.activation for d in plan.decisions if d.kind != "block"} == {"streamed"}
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             micro_batches=2, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=None,
                             plan=plan)
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=5, clip=None)


def test_tied_table_streams_for_both_layers_or_neither():
    model = make_model("llama", tied=True)
    for one in (("epilogue",), ("prologue",)):
        with pytest.raises(ValueError, match="tied table named for one layer only"):
            compile_streamed(model, one)
    plain = make_model("plain", tied=True)  # no get_output_embeddings: the head cannot stream, nor its table
    with pytest.raises(ValueError, match="cannot stream"):
        compile_streamed(plain, ("prologue", "epilogue"))


def test_planner_streams_a_tied_table_where_it_alone_fits():
    """Below the resident floor the planner streams the tied table (both layers); with room to spare,
    where streaming cannot be faster, it keeps it resident."""
    model = make_model("llama", tied=True)

    def plan(budget, **options):
        return slidedp.plan(model, budget, batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu",
                            solver_options=slidedp.SolverOptions(vocab_chunk_numel=CHUNK_NUMEL, **options))

    resident = plan("1GiB")
    assert {d.activation for d in resident.decisions if d.kind != "block"} == {"resident"}
    assert "streamed vocabulary (none)" in resident.solver["searches"]  # a decision of the model, not a sweep
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        plan(1, vocab_streamed=())
    floor = info.value.min_budget_bytes
    streamed = plan(floor - 1)
    assert {d.activation for d in streamed.decisions if d.kind != "block"} == {"streamed"}
    assert streamed.peak_device_bytes < floor
    head = next(g for g in streamed.groups if g.label == "epilogue")  # loaded twice, its gradient down once
    assert (head.h2d_bytes, head.d2h_bytes) == (2 * (VOCAB + 1) * 32 * 4, (VOCAB + 1) * 32 * 4)
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        plan(1)
    assert info.value.min_budget_bytes <= floor - VOCAB * 32 * (4 + 4)  # the table's weights and fp32 gradient


def test_checkpoints_cross_between_streamed_and_resident_tied_tables(tmp_path):
    """A checkpoint written with the tied table streamed loads with it resident and the other way: the
    state read back is the state written, bit for bit, and training goes on as torch.optim.AdamW's."""
    model = make_model("llama", tied=True)
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    both = ("prologue", "epilogue")
    saved = None
    for k, streamed in enumerate((both, (), both)):
        with compile_streamed(copy.deepcopy(model), streamed)[1] as engine:
            if saved is not None:
                engine.load_checkpoint(tmp_path / str(k - 1))
                assert all(torch.equal(w, saved[name]) for name, w in engine.state_dict().items())
            train_side_by_side(engine, ref, steps=2, seed=k, opt=opt)
            engine.save_checkpoint(tmp_path / str(k))
            saved = engine.state_dict()


def test_chunk_gradients_reuse_their_buffers_only_after_the_copies_they_were_sent_to():
    """vocab_stream.ChunkGrads: the chunks' gradients take VOCAB_GRAD_BUFFERS buffers in turn; before a
    buffer is zeroed again, the compute stream waits for the D2H point recorded when it was last sent."""
    from slidedp.backend.runtime.vocab_stream import ChunkGrads
    from slidedp.costmodel.memory import VOCAB_GRAD_BUFFERS

    class Streams:
        def __init__(self):
            self.log, self.n = [], 0

        def record(self, name):
            self.n += 1
            self.log.append(("record", name, self.n))
            return self.n

        def wait(self, name, event):
            self.log.append(("wait", name, event))

    streams = Streams()
    grads = ChunkGrads(streams, VOCAB_GRAD_BUFFERS, rows=3, hidden=4, device=torch.device("cpu"))
    ptrs = []
    for k in range(5):
        g = grads.take(3 if k < 4 else 2)
        assert g.shape == (3 if k < 4 else 2, 4) and not g.any()
        ptrs.append(g.data_ptr())
        g.fill_(1.0)
        grads.sent()
    assert len(set(ptrs)) == VOCAB_GRAD_BUFFERS == 2 and ptrs[0] == ptrs[2] == ptrs[4]
    waits = [e for kind, name, e in streams.log if kind == "wait"]
    assert all(name == "compute" for kind, name, _ in streams.log if kind == "wait")
    assert waits == [None, None, 1, 2, 3]  # the third take waits for the first send's point, and so on
    with pytest.raises(ValueError, match="rows"):
        grads.take(4)
