"""On a GPU (skipped without one): three bf16 steps match GPU-resident PyTorch within bf16 tolerance,
with compiled blocks, every activation policy and optimizer state on the device for the prologue and
a block; and close() gives back the device memory and the pinned host memory."""

import copy
import dataclasses
import gc

import pytest
import torch

import slidedp
from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.solve import solve_plan
from tests.engine.test_exactness import BATCH, SEQ, random_batch, reference_loss
from tests.models import make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LR, CLIP, STEPS = 1e-3, 1.0, 3


def test_three_steps_match_gpu_resident_and_close_frees_the_device():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pinned_before = pinned_host_bytes()
    model = make_model("qwen3")
    ref = copy.deepcopy(model).cuda().eval()
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.bfloat16)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["h200-sxm"], micro_batches=2,
                      compiled_blocks=True, options=SolverOptions(device_state_blocks=1, device_state_prologue=True))
    assert plan.device_state == (0, 1)
    policies = iter(["recompute", "keep", "offload"])
    plan = plan.replace(decisions=tuple(
        dataclasses.replace(d, activation=next(policies)) if d.kind == "block" else d for d in plan.decisions))
    engine = slidedp.compile(model, 2**30, batch_size=BATCH, seq_len=SEQ, device="cuda", precision="bf16",
                             optimizer=slidedp.AdamW(lr=LR), max_grad_norm=CLIP, plan=plan)
    engine.executor.min_offload_bytes = 0
    opt = train_against_gpu_resident(engine, ref)
    assert engine.executor.offloaded_bytes > 0
    engine.close()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    ref_bytes = sum(t.numel() * t.element_size() for t in list(ref.parameters()) + [
        s for group in opt.state.values() for s in group.values() if torch.is_tensor(s) and s.is_cuda])
    assert torch.cuda.memory_allocated() <= before + ref_bytes + (1 << 20)
    assert pinned_host_bytes() <= pinned_before  # staging buffers given back, not only cached


def pinned_host_bytes() -> int:
    """Bytes of pinned host memory torch's caching host allocator holds (in use or cached)."""
    stats = torch.cuda.host_memory_stats()
    return max(stats.get(key, 0) for key in ("reserved_bytes.current", "allocated_bytes.current"))


def train_against_gpu_resident(engine, ref):
    """STEPS steps of the engine and of fused torch AdamW on the GPU-resident `ref` (bf16 autocast),
    clipped at CLIP: the losses within bf16 tolerance, every weight within 2 lr a step. Returns the
    reference's optimizer."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        ids, labels = random_batch(gen, 2 * BATCH)
        loss = engine.step(ids, labels)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = reference_loss(ref, ids.cuda(), labels.cuda())
        opt.zero_grad()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=2e-2)
    state = engine.state_dict()
    for name, p in ref.named_parameters():  # each AdamW step moves a weight by at most about lr
        assert (state[name] - p.detach().float().cpu()).abs().max() <= 2 * LR * STEPS, name
    return opt


@pytest.mark.parametrize("worker", [False, True], ids=["engine-process", "worker-process"])
def test_streamed_updates_match_gpu_resident(monkeypatch, worker):
    """The prologue and two blocks updated on the device at the step boundary, several pieces each;
    in a worker process the multi-rank path (each layer marked updated once its copies landed)."""
    from slidedp.costmodel import memory

    monkeypatch.setattr(memory, "STREAMED_PIECE_NUMEL", 4096)  # this process only (not a worker's)
    if worker:
        monkeypatch.setenv("SLIDEDP_WORKER_PROCESSES", "1")
    model = make_model("qwen3")
    ref = copy.deepcopy(model).cuda().eval()
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.bfloat16)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["h200-sxm"], micro_batches=2,
                      compiled_blocks=True, streamed_updates=True,
                      options=SolverOptions(device_state_blocks=0, streamed_layers=3))
    assert plan.streamed_updates == (0, 1, 2)
    with slidedp.compile(model, 2**30, batch_size=BATCH, seq_len=SEQ, device="cuda", precision="bf16",
                         optimizer=slidedp.AdamW(lr=LR), max_grad_norm=CLIP, plan=plan) as engine:
        if not worker:
            assert engine.runner.streamed is not None and engine.runner.streamed.piece_numel == 4096
        train_against_gpu_resident(engine, ref)
