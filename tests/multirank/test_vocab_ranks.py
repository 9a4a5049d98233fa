"""Vocabulary-streamed tables over 2 CPU ranks (gloo): the CPU reduction of each chunk's gradient in
rank order, against single-process torch.optim.AdamW (docs/design.md §4.14)."""

import copy

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD
from tests.engine.test_vocab_stream import CHUNK_NUMEL
from tests.models import make_model
from tests.multirank.test_data_parallel import train_against_reference


def test_streamed_tables_on_two_ranks_match_torch_adamw():
    model = make_model("qwen3")
    ref = copy.deepcopy(model).eval()
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, world_size=2, precision="fp32",
                        hardware="rtx4090", micro_batches=2, solver_options=slidedp.SolverOptions(
                            vocab_streamed=("prologue", "epilogue"), vocab_chunk_numel=CHUNK_NUMEL))
    assert {d.activation for d in plan.decisions if d.kind != "block"} == {"streamed"}
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=2, micro_batches=2, plan=plan,
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP)
    with engine:
        train_against_reference(engine, ref, world_size=2, steps=3, accumulation=4)
