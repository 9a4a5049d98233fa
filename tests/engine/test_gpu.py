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
    assert engine.executor.block_runner.late_reload_bytes == 0  # back on the H2D stream, ahead of the backward
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


def test_device_state_takes_no_host_bytes_and_streams_checkpoints_and_exports(tmp_path):
    """Every layer's state on the GPU (one rank, bf16): the host state allocates nothing for them,
    the weights come up through the bounded staging buffer, the model's parameters are views of the
    device's fp32 master; training matches GPU-resident PyTorch; a checkpoint streamed down and read
    back into a fresh engine restores master and moments bitwise and goes on with the same losses;
    the export holds the master weights in bf16; close() gives back the device memory and leaves the
    trained weights in the model, on the CPU in the dtype they had."""
    from slidedp.costmodel import memory as mem
    from slidedp.run.checkpoint import read_master_weights

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).cuda().eval()
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.bfloat16)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["h200-sxm"], micro_batches=2,
                      compiled_blocks=True, options=SolverOptions(device_state_blocks=4, device_state_prologue=True))
    assert plan.device_state == tuple(range(len(graph.layers)))
    assert plan.host_memory["load_staging"] == mem.LOAD_STAGING_BYTES

    def compiled(m):
        return slidedp.compile(m, 2**30, batch_size=BATCH, seq_len=SEQ, device="cuda", precision="bf16",
                               optimizer=slidedp.AdamW(lr=LR), max_grad_norm=CLIP, plan=plan)

    engine = compiled(model)
    host = engine.host
    assert all(layout.lean and layout.master.nbytes == layout.grad.nbytes == 0 for layout in host.layouts)
    assert host.nbytes == mem._page(host.control_ints * 8)  # the control region alone
    for name, p in model.named_parameters():
        assert p.is_cuda and p.dtype == torch.float32, name
    train_against_gpu_resident(engine, ref)
    engine.save_checkpoint(tmp_path / "ck")
    state = engine.state_dict()
    moments = {i: {k: t.cpu() for k, t in engine.runner.device_state.arrays(i).items()} for i in plan.device_state}
    assert all(torch.equal(read_master_weights(tmp_path / "ck")[k], v) for k, v in state.items())
    engine.export_hf(tmp_path / "hf", dtype="bf16")
    gen = torch.Generator().manual_seed(8)
    later = [random_batch(gen, 2 * BATCH) for _ in range(2)]
    losses = [engine.step(*b) for b in later]
    engine.close()
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
    del engine
    gc.collect()
    torch.cuda.synchronize()

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, state[name].bfloat16()), name
    fresh = compiled(make_model("qwen3", tied=True, seed=1))
    fresh.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in state.items())
    for i, arrays in moments.items():
        assert all(torch.equal(t.cpu(), arrays[k]) for k, t in fresh.runner.device_state.arrays(i).items())
    assert [fresh.step(*b) for b in later] == pytest.approx(losses, rel=1e-3)
    fresh.close()
    del fresh
    gc.collect()
    torch.cuda.synchronize()
    ref_bytes = sum(t.numel() * t.element_size() for t in ref.parameters())
    assert torch.cuda.memory_allocated() <= before + ref_bytes + (1 << 20)


def test_staging_between_the_gpu_and_the_host_in_pieces():
    from slidedp.backend.state.staging import copy_in_pieces_, pieces_from, pieces_into, to_host

    src = torch.randn(100_003, device="cuda")
    got = torch.cat([piece.clone() for _, _, piece in pieces_from(src, piece_bytes=4096)])
    assert torch.equal(got, src.cpu())
    dst = torch.empty_like(src)
    host = src.cpu()
    for lo, hi, piece in pieces_into(dst, piece_bytes=4096):
        assert piece.is_pinned() and piece.numel() <= 1024
        piece.copy_(host[lo:hi])
    assert torch.equal(dst, src)
    copy_in_pieces_(dst, host.bfloat16(), piece_bytes=4096)
    assert torch.equal(dst.cpu(), host.bfloat16().float())
    assert torch.equal(to_host(src, torch.bfloat16, piece_bytes=4096), src.bfloat16().cpu())
