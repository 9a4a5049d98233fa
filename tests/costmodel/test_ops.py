"""Cost functions: each against its equation, with hand-computed numbers."""

import json
import math
from dataclasses import replace

import pytest

from slidedp.costmodel import memory, ops
from slidedp.costmodel.hardware import PRESETS, Hardware
from slidedp.ir.graph import LayerCosts

KiB, MiB, GiB = 2**10, 2**20, 2**30
H200 = PRESETS["h200-sxm"]


@pytest.mark.parametrize("size, gbps", [
    (64 * KiB, 2.4), (MiB, 30), (4 * MiB, 46), (16 * MiB, 52), (64 * MiB, 54)])
def test_transfer_time_reproduces_the_measured_h200_curve(size, gbps):
    t = ops.transfer_time_s(size, H200.h2d_bytes_per_s, H200.transfer_efficiency)
    assert t == pytest.approx(size / (gbps * 1e9))


def test_transfer_rate_grows_with_size_and_small_copies_cost_their_latency():
    curve = H200.transfer_efficiency
    sizes = [2**k for k in range(10, 34)]
    rates = [s / ops.transfer_time_s(s, 55e9, curve) for s in sizes]
    assert all(a <= b for a, b in zip(rates, rates[1:]))
    # below the smallest measured size a copy takes the same time (latency-bound)
    assert ops.transfer_time_s(4 * KiB, 55e9, curve) == pytest.approx(ops.transfer_time_s(64 * KiB, 55e9, curve))
    assert ops.transfer_time_s(0, 55e9, curve) == 0
    # scaled to the hardware's bandwidth: half the link, twice the time
    assert ops.transfer_time_s(MiB, 27.5e9, curve) == pytest.approx(2 * ops.transfer_time_s(MiB, 55e9, curve))
    # chunks: k copies of size/k
    assert ops.chunked_transfer_time_s(64 * MiB, 16, 55e9, curve) == pytest.approx(16 * 4 * MiB / 46e9)


def test_link_share_splits_the_root_complex_and_host_dram():
    hw = PRESETS["rtx4090"]  # two GPUs per root complex
    assert ops.ranks_per_link(hw, 1) == 1 and ops.ranks_per_link(hw, 4) == 2
    assert ops.link_share_bytes_per_s(25e9, hw, 2) == pytest.approx(12.5e9)
    h100 = PRESETS["h100-sxm"]  # one GPU per link; 8 ranks reading host DRAM at once
    assert ops.link_share_bytes_per_s(50e9, h100, 8) == pytest.approx(200e9 / 8)
    assert ops.link_share_bytes_per_s(50e9, h100, 2) == pytest.approx(50e9)
    # both directions at once: duplex/2 each, and DRAM split over 2 W streams
    assert ops.h2d_bytes_per_s(h100, 1, duplex=True) == pytest.approx(45e9)
    assert ops.d2h_bytes_per_s(h100, 4, duplex=True) == pytest.approx(200e9 / 8)
    assert ops.h2d_bytes_per_s(h100, 1, duplex=False) == pytest.approx(50e9)


def test_compute_update_and_offload_times():
    hw = PRESETS["h100-sxm"]
    costs = LayerCosts(flops_fwd=4.5e12, flops_bwd=9e12)
    rate = 750e12 * 0.6
    assert ops.forward_time_s(costs, hw, 2) == pytest.approx(2 * 4.5e12 / rate)
    assert ops.recompute_time_s(costs, hw, 2) == ops.forward_time_s(costs, hw, 2)
    assert ops.backward_time_s(costs, hw, 2, recompute=False) == pytest.approx(2 * 9e12 / rate)
    assert ops.backward_time_s(costs, hw, 2, recompute=True) == pytest.approx(2 * 13.5e12 / rate)
    assert ops.cpu_update_time_s(6e9, hw, contended=False) == pytest.approx(1.0)
    assert ops.cpu_update_time_s(6e9, hw) == pytest.approx(1 / 0.66)
    assert ops.cpu_update_time_s(6e9 / 4, hw, lanes=4, contended=False) == pytest.approx(1.0)
    # no bf16 delivery copy written (made on load): 26 of the 30 bytes per parameter
    assert ops.cpu_update_time_s(6e9, hw, contended=False, copy_written=False) == pytest.approx(26 / 30)
    assert ops.offload_time_s(GiB, 2, 50e9, hw.transfer_efficiency) == pytest.approx(2 * GiB / 50e9)
    # the W-copy sum of the CPU reduction: numel * (W * elem + 4) bytes at host_dram / lanes
    assert ops.cpu_reduce_time_s(1e9, 2, 4, hw, lanes=4) == pytest.approx(1e9 * 12 * 4 / 200e9)
    assert ops.cpu_reduce_time_s(1e9, 2, 1, hw, lanes=1) == 0


def test_block_times_are_bounded_below_by_the_host_and_the_head_has_its_own_rate():
    hw = replace(PRESETS["h100-sxm"], host_block_fwd_s=2e-3, host_block_bwd_s=6e-3, head_efficiency=0.4)
    rate = 750e12 * 0.6
    big = LayerCosts(flops_fwd=4.5e12, flops_bwd=9e12)  # 10 / 20 ms on the GPU: the GPU bounds
    assert ops.block_forward_time_s(big, hw, 2) == pytest.approx(2 * 4.5e12 / rate)
    assert ops.block_backward_time_s(big, hw, 2, recompute=True) == pytest.approx(2 * 13.5e12 / rate)
    small = LayerCosts(flops_fwd=4.5e11, flops_bwd=9e11)  # 1 / 2 ms on the GPU: the host bounds
    assert ops.block_forward_time_s(small, hw, 3) == pytest.approx(3 * 2e-3)
    assert ops.block_backward_time_s(small, hw, 3, recompute=False) == pytest.approx(3 * 6e-3)
    assert ops.block_backward_time_s(small, hw, 3, recompute=True) == pytest.approx(3 * 8e-3)
    head = LayerCosts(flops_fwd=3e12, flops_bwd=6e12)
    assert ops.epilogue_time_s(head, hw, 2) == pytest.approx(2 * 9e12 / (750e12 * 0.4))
    # without host figures (0) and head efficiency (0): the flop-rate formulas
    plain = PRESETS["h100-sxm"]
    assert ops.block_forward_time_s(small, plain, 3) == pytest.approx(ops.forward_time_s(small, plain, 3))
    assert ops.block_backward_time_s(small, plain, 3, recompute=True) == pytest.approx(
        ops.backward_time_s(small, plain, 3, recompute=True))
    assert ops.epilogue_time_s(head, plain, 2) == pytest.approx(
        ops.forward_time_s(head, plain, 2) + ops.backward_time_s(head, plain, 2, recompute=False))
    with pytest.raises(ValueError, match="host_block_bwd_s"):
        replace(plain, host_block_bwd_s=-1.0)
    # attention at its own rate (the rest at the block's); 0 (unmeasured): all at the block's
    attn = LayerCosts(flops_fwd=4.5e12, flops_bwd=9e12, attention_flops_fwd=1.5e12, attention_flops_bwd=3e12)
    fast = replace(hw, attention_flops_per_s=1e15)
    assert ops.block_forward_time_s(attn, fast, 2) == pytest.approx(2 * (3e12 / rate + 1.5e12 / 1e15))
    assert ops.block_backward_time_s(attn, fast, 2, recompute=True) == pytest.approx(
        2 * (9e12 / rate + 4.5e12 / 1e15))
    assert ops.block_backward_time_s(attn, hw, 2, recompute=True) == pytest.approx(2 * 13.5e12 / rate)
    compiled = replace(fast, compiled_block_efficiency=0.8)
    assert ops.block_backward_time_s(attn, compiled, 1, recompute=False, compiled=True) == pytest.approx(
        6e12 / (750e12 * 0.8) + 3e12 / 1e15)
    with pytest.raises(ValueError, match="attention_flops_per_s"):
        replace(hw, attention_flops_per_s=-1.0)
    # a compiled block's own host floor: not the eager one; none where not measured (0)
    tiny = LayerCosts(flops_fwd=3e9, flops_bwd=6e9)  # microseconds on the GPU
    assert ops.block_forward_time_s(tiny, compiled, 3, compiled=True) == pytest.approx(3 * 3e9 / (750e12 * 0.8))
    floored = replace(compiled, host_compiled_fwd_s=1e-3, host_compiled_bwd_s=1.5e-3)
    assert ops.block_forward_time_s(tiny, floored, 3, compiled=True) == pytest.approx(3 * 1e-3)
    assert ops.block_backward_time_s(tiny, floored, 3, recompute=False, compiled=True) == pytest.approx(3 * 1.5e-3)
    assert ops.block_backward_time_s(tiny, floored, 3, recompute=True, compiled=True) == pytest.approx(3 * 2.5e-3)
    assert ops.block_backward_time_s(big, floored, 2, recompute=True, compiled=True) == pytest.approx(
        ops.block_backward_time_s(big, compiled, 2, recompute=True, compiled=True))  # the GPU bounds
    with pytest.raises(ValueError, match="host_compiled_bwd_s"):
        replace(plain, host_compiled_bwd_s=-1.0)
    # profiles written before these fields existed still load (defaults)
    data = plain.to_dict()
    for key in ("host_block_fwd_s", "host_block_bwd_s", "head_efficiency", "attention_flops_per_s",
                "host_compiled_fwd_s", "host_compiled_bwd_s"):
        data.pop(key)
    assert Hardware.from_dict(data) == plain


def test_collectives_ring_over_p2p_and_bounce_through_the_host_without_it():
    h100 = PRESETS["h100-sxm"]
    assert ops.all_gather_time_s(8e9, 4, h100) == pytest.approx(6e9 / 450e9)
    assert ops.reduce_scatter_time_s(8e9, 4, h100) == pytest.approx(6e9 / 450e9)
    assert ops.all_gather_time_s(8e9, 1, h100) == 0
    rtx = PRESETS["rtx4090"]
    bounce = ops.all_gather_time_s(8e9, 4, rtx)
    d2h, h2d = ops.d2h_bytes_per_s(rtx, 4, duplex=True), ops.h2d_bytes_per_s(rtx, 4, duplex=True)
    assert bounce == pytest.approx(2e9 / d2h + 6e9 / h2d)
    # sharded delivery through the host is never faster than copying the layer whole
    whole = ops.transfer_time_s(8e9, ops.h2d_bytes_per_s(rtx, 4, duplex=False), rtx.transfer_efficiency)
    shard = ops.transfer_time_s(2e9, ops.h2d_bytes_per_s(rtx, 4, duplex=False), rtx.transfer_efficiency)
    assert shard + bounce > whole


def test_host_dram_traffic_per_route():
    assert ops.delivery_dram_bytes(1e9, 8, "replicated") == 8e9
    assert ops.delivery_dram_bytes(1e9, 8, "sharded") == 1e9
    assert ops.reduction_dram_bytes(5e8, 2, 4, "cpu") == 2 * 4 * 1e9 + 4 * 5e8
    assert ops.reduction_dram_bytes(5e8, 2, 4, "gpu") == 1e9
    assert ops.reduction_dram_bytes(5e8, 2, 1, "cpu") == 1e9
    with pytest.raises(ValueError):
        ops.delivery_dram_bytes(1, 1, "carrier pigeon")


def test_memory_buffers():
    assert memory.weight_slots_bytes(100, 2, 3) == 600
    assert memory.grad_accumulators_bytes(100) == 800
    assert memory.grad_staging_bytes(100, 2, 4, 1, "cpu") == 2 * 25 * 2
    assert memory.grad_staging_bytes(100, 4, 4, 1, "cpu") == 0
    assert memory.grad_staging_bytes(100, 2, 4, 4, "gpu") == 200 + 50
    # Qwen3-14B, 8 x 4096 tokens: the fp32 logits alone would be 20 GB; the chunked loss holds
    # one chunk of 4096 tokens: fused, its fp32 logits and bf16 dlogits (6 B a logit); through the
    # model's own logits and autograd, 12 B a logit.
    tokens, hidden, vocab = 8 * 4096, 5120, 151936
    assert tokens * vocab * 4 > 19e9
    chunked = memory.epilogue_working_bytes(tokens, hidden, vocab, 2, 4096, fused=True)
    assert chunked == tokens * hidden * (3 * 2 + 4) + 4096 * vocab * 6
    assert chunked < 0.3 * tokens * vocab * 4  # under a third of the full fp32 logits
    unfused = memory.epilogue_working_bytes(tokens, hidden, vocab, 2, 4096, fused=False)
    assert unfused == tokens * hidden * (3 * 2 + 4) + 4096 * vocab * 12
    small = memory.epilogue_working_bytes(100, 8, 10, 2, 4096, fused=True)
    assert small == max(100 * 8 * 10 + 100 * 10 * 6, 100 * 8 * 30)
    assert memory.logit_bytes(4, True) == 8 and memory.logit_bytes(4, False) == 16
    # one long sequence: the fp32 norm's backward outgrows a chunk's logits (Qwen3-4B, 262,144
    # tokens: 18.75 GiB; measured 17.5 GiB of the epilogue live at the step's peak)
    long = memory.epilogue_working_bytes(262144, 2560, vocab, 2, 4096, fused=True)
    assert long == 262144 * 2560 * 30 and 17.5 * GiB < long < 19 * GiB


def test_streamed_epilogue_holds_every_micro_batch_and_one_backward_at_a_time():
    """A head streamed by vocabulary chunk keeps each micro-batch's hidden state, norm, gradients and
    per-token loss terms through the pass; the transients on top are one chunk's dlogits and
    hidden-state gradient, or one micro-batch's final-norm backward, not every micro-batch's at once."""
    T, H, rows, e = 4096, 4096, 7997, 2
    held = T * H * (3 * e + 8) + T * 16
    one = memory.streamed_epilogue_working_bytes(T, H, rows, e, 4096, 1)
    assert one == held + max(T * H * e + max(T * rows * e, T * H * 4), T * H * 24)
    sixteen = memory.streamed_epilogue_working_bytes(T, H, rows, e, 4096, 16)
    assert sixteen - one == 15 * held  # each further micro-batch adds what it holds, no further transient
    # a long chunk of a wide vocabulary slice: its dlogits outgrow the norm's backward
    wide = memory.streamed_epilogue_working_bytes(T, 256, 50000, e, 4096, 1)
    assert wide == T * 256 * (3 * e + 8) + T * 16 + T * 256 * e + T * 50000 * e


def test_hardware_profile_round_trips_through_json_with_its_curve(tmp_path):
    hw = replace(PRESETS["a100-sxm"], transfer_efficiency=((1024, 0.1), (2**20, 0.9)))
    path = tmp_path / "hw.json"
    hw.save(path)
    assert Hardware.load(path) == hw
    assert json.loads(path.read_text())["transfer_efficiency"] == [[1024, 0.1], [1048576, 0.9]]
    assert Hardware.from_dict({k: v for k, v in PRESETS["cpu"].to_dict().items() if k != "transfer_efficiency"})
    with pytest.raises(ValueError, match="transfer_efficiency"):
        replace(hw, transfer_efficiency=((2**20, 0.5), (1024, 0.9)))
    assert math.isclose(ops.transfer_efficiency(2**30, hw.transfer_efficiency), 0.9)


def test_a_block_is_host_bound_where_the_hosts_floor_passes_its_device_time():
    """ops.block_host_and_device_s: the host's floor (compiled or eager, by the block's kind) beside the
    device's time of one micro-batch's forward and backward; a plan whose blocks are host-bound says so."""
    from slidedp.scheduler.decisions import SolverOptions
    from slidedp.scheduler.solve import solve_plan
    from tests.scheduler.graphs import synthetic_graph

    hw = replace(PRESETS["h100-sxm"], compiled_block_efficiency=0.6, host_compiled_fwd_s=1e-3,
                 host_compiled_bwd_s=2e-3, host_block_fwd_s=0.0, host_block_bwd_s=0.0)
    small = LayerCosts(flops_fwd=3e10, flops_bwd=6e10)
    host, device = ops.block_host_and_device_s(small, hw, compiled=True)
    assert host == pytest.approx(3e-3) and device == pytest.approx(9e10 / (750e12 * 0.6))
    assert ops.block_host_and_device_s(small, hw, compiled=False)[0] == 0  # eager: its own floor, 0 here
    graph = synthetic_graph(2)
    quick = dict(windows=(2,), chunk_multiples=(1,), activations=("recompute",), update_orders=("forward",),
                 device_state_blocks=0)
    notes = {}
    for name, floors in (("none", (0.0, 0.0)), ("floored", (1.0, 2.0))):  # a floor far above any block's time
        h = replace(hw, host_block_fwd_s=floors[0], host_block_bwd_s=floors[1])
        plan = solve_plan(graph, budget_bytes=12 * 2**30, hardware=h, options=SolverOptions(**quick))
        notes[name] = [n for n in plan.notes if n.startswith("blocks host-bound")]
    assert notes["none"] == [] and len(notes["floored"]) == 1 and "3000.00 ms to issue" in notes["floored"][0]
