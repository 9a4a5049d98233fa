"""Vocabulary-streamed tables over 2 CPU ranks (gloo), against single-process torch.optim.AdamW
(docs/design.md §4.14): the CPU reduction of each chunk's gradient in rank order, and every other
route: the sharded delivery (each owner copies its part of a row chunk from the host, the ranks
broadcast it) and the GPU reduction (each owner's part of a chunk's gradient summed onto it, copied
down by it alone, counted in the norm by it); a tied table streamed for both of its uses. Several
hosts: tests/multirank/test_hosts.py."""

import copy

import pytest

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD
from tests.engine.test_vocab_stream import CHUNK_NUMEL
from tests.models import make_model
from tests.multirank.test_data_parallel import compile_ranks, routed_plan, train_against_reference


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


@pytest.mark.parametrize("route", [("sharded", "gpu"), ("sharded", "cpu"), ("replicated", "gpu")],
                         ids=lambda r: "-".join(r))
def test_streamed_tables_on_every_route_match_torch_adamw(route):
    """Row chunks of 7 rows across the layer's 4 owner chunks (2 per rank), two micro-batches a pass,
    two passes (the later one's parts added on the host), clipping."""
    model = make_model("qwen3")
    ref = copy.deepcopy(model).eval()
    plan = routed_plan(model, 2, route, micro_batches=2, vocab_streamed=("prologue", "epilogue"),
                       vocab_chunk_numel=CHUNK_NUMEL)
    edges = [d for d in plan.decisions if d.kind != "block"]
    assert {d.activation for d in edges} == {"streamed"} and {(d.delivery, d.reduction) for d in edges} == {route}
    assert plan.vocab_chunk_rows == 7 and all(d.chunks == 4 for d in edges)
    with compile_ranks(model, 2, plan, micro_batches=2) as engine:
        train_against_reference(engine, ref, world_size=2, steps=3, accumulation=4)


@pytest.mark.parametrize("route, passes", [(("replicated", "cpu"), 2), (("sharded", "gpu"), 1)],
                         ids=["replicated-cpu", "sharded-gpu"])
def test_tied_table_on_two_ranks_matches_torch_adamw(route, passes):
    """A tied table streamed for both uses over 2 ranks: the head's and the embedding's chunk gradients
    of every rank summed into the one host gradient (in rank order over two passes, or onto the
    owners and added there in one pass, where the norm is otherwise taken on the GPUs), its norm taken
    once from the sum; clipping."""
    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).eval()
    plan = routed_plan(model, 2, route, micro_batches=2, vocab_streamed=("prologue", "epilogue"),
                       vocab_chunk_numel=CHUNK_NUMEL)
    edges = [d for d in plan.decisions if d.kind != "block"]
    assert {d.activation for d in edges} == {"streamed"} and {(d.delivery, d.reduction) for d in edges} == {route}
    with compile_ranks(model, 2, plan, micro_batches=2) as engine:
        train_against_reference(engine, ref, world_size=2, steps=3, accumulation=2 * passes)
