"""recompute_offload: a block recomputed in its backward from its input, which waits in host memory
between its forward and backward. The same tensor goes down and back up, so a step is bit for bit
the step of the same plan with recompute, and exact against torch.optim.AdamW (CPU, fp32: "host"
and "device" are both the CPU, the copies and the arena run all the same)."""

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slidedp
from slidedp.backend.lowering.program import D2H_INPUT, FREE, H2D_INPUT
from slidedp.backend.lowering.verify import verify_program
from slidedp.scheduler.problem.lanes import window_loads
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, random_batch, train_side_by_side
from tests.models import PlainLM, _common

# block 0's input is the prologue's output, block 3's the kept block 2's output: both stay on the
# device; blocks 1 and 4 (before them recomputed blocks) leave it; block 5 is the last (no window)
POLICIES = ["recompute_offload", "recompute_offload", "keep", "recompute_offload", "recompute_offload",
            "recompute_offload"]
OFFLOADED = {1, 4}


def make_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**{**_common(False), "num_hidden_layers": len(POLICIES)}))
    return PlainLM(n_blocks=len(POLICIES), tied=True)


def planned(model, activations, *, window: int, chunks: int):
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, precision="fp32", device="cpu", micro_batches=2)
    policies = iter(activations)
    decisions = tuple(dataclasses.replace(d, chunks=chunks, owners=(),
                                          activation=next(policies) if d.kind == "block" else d.activation)
                      for d in plan.decisions)
    n_blocks = sum(d.kind == "block" for d in decisions)
    return plan.replace(decisions=decisions, window=window, window_loads=window_loads(n_blocks, window))


def engine_for(model, plan):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, plan=plan)


@pytest.mark.parametrize("family, window, chunks", [("llama", 2, 1), ("plain", 1, 3)])
def test_recompute_offload_is_recompute_bit_for_bit_and_exact(family, window, chunks):
    model = make_model(family)
    plain_policies = ["recompute" if p == "recompute_offload" else p for p in POLICIES]
    engines = [engine_for(copy.deepcopy(model), planned(model, policies, window=window, chunks=chunks))
               for policies in (POLICIES, plain_policies)]
    program = engines[0].executor.program
    verify_program(program)
    assert {op.block for op in program.ops if op.kind == D2H_INPUT} == OFFLOADED
    assert {op.block for op in program.ops if op.kind == H2D_INPUT} == OFFLOADED
    # each freed between its copy down and its copy back, the free waiting for the copy down
    for op in program.ops:
        if op.kind == D2H_INPUT:
            assert any(f.kind == FREE and f.buffer == f"act[{op.block}]" and op.record in f.waits for f in program.ops)
    gen = torch.Generator().manual_seed(11)
    with engines[0] as offloading, engines[1] as recomputing:
        for _ in range(3):
            ids, labels = random_batch(gen, 2 * BATCH)
            assert offloading.step(ids, labels) == recomputing.step(ids, labels)
        assert offloading.executor.offloaded_bytes > 0 and offloading.executor.arena.used > 0
        assert recomputing.executor.offloaded_bytes == 0
        a, b = offloading.state_dict(), recomputing.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref = copy.deepcopy(model).eval()
    with engine_for(model, planned(model, POLICIES, window=window, chunks=chunks)) as engine:
        train_side_by_side(engine, ref, steps=2, seed=5)


def test_the_plan_counts_offloaded_inputs_in_host_memory():
    """The host arena and the preflight's count take each recompute_offload block's input per micro-batch."""
    from slidedp.run.preflight import offloaded_activation_bytes
    from slidedp.scheduler.plan import host_activation_bytes

    model = make_model("llama")
    plan = planned(model, POLICIES, window=2, chunks=1)
    with engine_for(model, plan) as engine:
        graph = engine.graph
        blocks = [layer for layer in graph.layers if layer.kind == "block"]
        per_pass = 2 * sum(host_activation_bytes(layer, p) for layer, p in zip(blocks, POLICIES))
        assert per_pass == 2 * 5 * blocks[0].costs.boundary_activation_bytes  # keep puts nothing there
        assert offloaded_activation_bytes(graph, plan) == per_pass
        engine.step(random_batch(torch.Generator().manual_seed(0), 2 * BATCH)[0])
        assert engine.executor.arena.buffer.numel() >= per_pass
        assert engine.executor.offloaded_bytes == 2 * len(OFFLOADED) * blocks[0].costs.boundary_activation_bytes
        assert "block inputs offloaded" in plan.summary()
