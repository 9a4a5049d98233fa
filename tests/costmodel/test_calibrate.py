"""`slidedp calibrate`: the aggregation helpers on synthetic timings, a quick CPU calibration, the
profile's JSON round trip, the command, and planning with a calibrated profile."""

import json
import math
import os
import time

import numpy as np
import pytest
import torch

import slidedp
from slidedp.cli import main
from slidedp.profiler import calibrate as cal
from slidedp.costmodel.hardware import PRESETS, Hardware
from slidedp.costmodel.ops import transfer_time_s
from slidedp.scheduler.plan import Plan
from tests.models import make_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# -- helpers on synthetic timings -----------------------------------------------------------------


def test_transfer_profile_from_latency_plus_bandwidth_timings():
    latency_s, bandwidth = 10e-6, 50e9
    sizes = [2**16 * 4**k for k in range(8)]
    samples = [(s, latency_s + s / bandwidth) for s in reversed(sizes)]  # any order
    peak, curve = cal.transfer_profile(samples)
    assert peak == pytest.approx(sizes[-1] / (latency_s + sizes[-1] / bandwidth), rel=1e-12)
    assert [b for b, _ in curve] == sizes
    for (s, f) in curve:
        assert f == pytest.approx(s / (latency_s + s / bandwidth) / peak, rel=1e-12)
    assert curve[-1][1] == 1.0 and all(0 < f <= 1 for _, f in curve)
    # the cost model gives back every measured time
    for s, t in samples:
        assert transfer_time_s(s, peak, curve) == pytest.approx(t, rel=1e-12)


def test_transfer_profile_normalises_to_the_fastest_size():
    # a mid-size copy faster than the largest (cache): it is the reference, the largest gets < 1
    peak, curve = cal.transfer_profile([(1000, 1e-6), (2000, 1e-6), (4000, 4e-6)])
    assert peak == 2e9
    assert curve == ((1000, 0.5), (2000, 1.0), (4000, 0.5))
    Hardware(**{**PRESETS["cpu"].to_dict(), "transfer_efficiency": curve})  # a valid profile curve


@pytest.mark.parametrize("samples", [[], [(1000, 0.0)], [(0, 1.0)], [(1000, 1.0), (1000, 2.0)]])
def test_transfer_profile_refuses_bad_samples(samples):
    with pytest.raises(ValueError):
        cal.transfer_profile(samples)


def test_large_copy_rate_inverts_the_cost_model():
    curve = ((2**20, 0.5), (2**30, 1.0))
    for nbytes, seconds in ((2**10, 1e-5), (2**24, 1e-3), (2**31, 0.04)):
        rate = cal.large_copy_rate(nbytes, seconds, curve)
        assert transfer_time_s(nbytes, rate, curve) == pytest.approx(seconds, rel=1e-12)
    assert cal.large_copy_rate(2**30, 0.02, curve) == 2**30 / 0.02


@pytest.mark.parametrize("max_threads, counts", [
    (1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (12, (1, 2, 4, 8, 12)), (16, (1, 2, 4, 8, 16)),
])
def test_thread_counts(max_threads, counts):
    assert cal.thread_counts(max_threads) == counts


def test_adamw_rates_median_and_fraction():
    assert cal.adamw_rates(10**6, [(4, 0.25), (1, 1.0), (2, 0.5)]) == ((1, 1e6), (2, 2e6), (4, 4e6))
    assert cal.median_s([3.0, 1.0, 2.0, 100.0, 1.5]) == 2.0
    assert cal.fraction_kept(2.62e9, 3.97e9) == pytest.approx(0.66, abs=1e-3)
    assert cal.fraction_kept(4.1e9, 4.0e9) == 1.0  # noise never gives more than all of it
    for bad in (lambda: cal.median_s([]), lambda: cal.median_s([1.0, 0.0]), lambda: cal.thread_counts(0),
                lambda: cal.adamw_rates(10, [(0, 1.0)]), lambda: cal.fraction_kept(0.0, 1.0)):
        with pytest.raises(ValueError):
            bad()


def block_flops_by_hand(s: cal.BlockShape) -> float:
    """Linear layers 6 T P; causal SDPA half of 4 b H s^2 d forward and 2.5 times that backward
    (FlopCounterMode's count of every query-key pair, halved)."""
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    linear_params = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    attention = 2 * s.batch_size * s.num_attention_heads * s.seq_len**2 * s.head_dim
    return 6 * s.batch_size * s.seq_len * linear_params + 3.5 * attention


@pytest.mark.parametrize("shape", [cal.BlockShape(64, 96, 4, 2, 16, seq_len=32, batch_size=2), cal.QWEN3_4B_BLOCK])
def test_block_flops_are_counted_as_the_ir_counts_them(shape):
    assert cal.count_block_flops(shape) == block_flops_by_hand(shape)


def test_block_flops_match_the_layer_ir():
    from transformers import Qwen3ForCausalLM

    from slidedp.ir.build import build_layer_graph

    shape = cal.BlockShape(64, 96, 4, 2, 16, seq_len=32, batch_size=2)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cal.qwen3_block_config(shape, num_hidden_layers=2))
    graph = build_layer_graph(model, batch_size=2, seq_len=32)
    block = graph.blocks[0]
    assert block.costs.flops_fwd + block.costs.flops_bwd == cal.count_block_flops(shape)
    assert (block.costs.flops_fwd, block.costs.flops_bwd) == cal.count_block_flops_fwd_bwd(shape)
    assert cal.measure_block_fwd_bwd_s(torch.device("cpu"), shape, repeats=1) > 0
    # what compiled blocks run (forward without autograd, then forward and backward), compiled first
    assert cal.measure_block_fwd_bwd_s(torch.device("cpu"), shape, repeats=1, compiled=True) > 0


def test_default_sizes_sweep_64kib_to_1gib_and_quick_is_smaller():
    sweep = tuple(2**16 * 4**k for k in range(8))
    assert sweep[-1] == 2**30
    for cuda in (True, False):
        full, quick = cal.default_sizes(cuda, quick=False), cal.default_sizes(cuda, quick=True)
        assert full.transfer_bytes == sweep and full.host_copy_bytes >= 2**30
        assert quick.transfer_bytes == sweep[:len(quick.transfer_bytes)] and quick.transfer_bytes[-1] <= 64 * 2**20
        assert quick.adamw_numel < full.adamw_numel and quick.host_copy_bytes < full.host_copy_bytes
    assert cal.default_sizes(True, quick=False).block == cal.QWEN3_4B_BLOCK


# -- the Hardware field ----------------------------------------------------------------------------


def test_adamw_by_threads_field_defaults_normalises_and_validates():
    assert all(hw.cpu_adamw_params_per_s_by_threads == () for hw in PRESETS.values())
    old = PRESETS["cpu"].to_dict()
    del old["cpu_adamw_params_per_s_by_threads"]  # a profile saved before the field existed
    assert Hardware.from_dict(old) == PRESETS["cpu"]
    hw = Hardware.from_dict({**old, "cpu_adamw_params_per_s_by_threads": [[1, 1e8], [2, 1.9e8]]})
    assert hw.cpu_adamw_params_per_s_by_threads == ((1, 1e8), (2, 1.9e8))
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    for bad in ([[2, 1e8], [1, 2e8]], [[1, 0.0]], [[0, 1e8]]):
        with pytest.raises(ValueError, match="cpu_adamw_params_per_s_by_threads"):
            Hardware.from_dict({**old, "cpu_adamw_params_per_s_by_threads": bad})


# -- a quick CPU calibration -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_cpu():
    lines = []
    shape = dict(hidden_size=96, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 seq_len=64)
    return cal.calibrate(device="cpu", quick=True, progress=lines.append, model_shape=shape), lines


def test_quick_cpu_calibration_is_plausible(quick_cpu):
    hw, lines = quick_cpu
    assert hw.name == "calibrated:cpu" and hw.cpu_cores == os.cpu_count()
    assert 1e8 <= hw.host_dram_bytes_per_s <= 1e12
    for rate in (hw.h2d_bytes_per_s, hw.d2h_bytes_per_s, hw.duplex_bytes_per_s):
        assert 1e7 <= rate <= 1e12
    # the block's rate is what the cost model uses; the split into matmul x efficiency is noisier
    assert 1e7 <= hw.matmul_flops_per_s <= 1e14 and 1e6 <= hw.matmul_flops_per_s * hw.block_efficiency <= 1e14
    assert hw.gpu_memory_bytes > 2**28 and hw.gpu_p2p_bytes_per_s == 0.0
    assert hw.cpu_adamw_contended_fraction == 1.0 and hw.gpus_per_root_complex == 1
    assert hw.duplex_contended_fraction == 1.0  # no DMA beside the CPU's AdamW on the CPU device
    assert 0 < hw.cpu_adamw_backward_fraction <= 1  # early updates: out of place, measured
    assert hw.gpu_memory_bytes_per_s == 0.0  # the CPU device: optimizer state never planned "on the device"
    sizes = [b for b, _ in hw.transfer_efficiency]
    assert sizes == sorted(set(sizes)) and sizes[0] == 64 * 2**10
    assert all(0 < f <= 1 for _, f in hw.transfer_efficiency)
    assert max(f for _, f in hw.transfer_efficiency) == 1.0
    threads = [t for t, _ in hw.cpu_adamw_params_per_s_by_threads]
    assert threads == list(cal.thread_counts(threads[-1])) and threads[-1] <= os.cpu_count()
    assert hw.cpu_adamw_params_per_s == max(r for _, r in hw.cpu_adamw_params_per_s_by_threads)
    assert 1e6 <= hw.cpu_adamw_params_per_s <= 1e11
    text = "\n".join(lines)
    assert "Qwen3 hidden 96, 1x64 tokens" in text  # the model_shape given
    for words in ("matmul", "block fwd+bwd", "H2D by size", "D2H", "H2D + D2H", "host DRAM", "CPU AdamW",
                  "AdamW + copies", "early update", "GPU-to-GPU", "root complex", "memory", "largest IQR/median"):
        assert words in text
    assert all(math.isfinite(v) for v in (hw.matmul_flops_per_s, hw.block_efficiency, hw.h2d_bytes_per_s))


def test_device_adamw_bandwidth_runs_the_device_state_update():
    """The measurement behind gpu_memory_bytes_per_s (CUDA calibrations), here on the CPU: the same
    kernel sequence as backend/state/device_state.py, its bytes over its time."""
    rate = cal.measure_device_adamw_bytes_per_s(torch.device("cpu"), 1 << 20, repeats=2)
    assert 1e7 <= rate <= 1e13


def test_the_early_updates_adamw_is_timed_out_of_place():
    """cpu_adamw_backward_fraction's measurement: the AdamW writes the new state beside the old one, as an
    early update does, and leaves its inputs as they were."""
    state = cal.AdamwState(1 << 16)
    before = [a.copy() for a in (state.param, state.exp_avg, state.exp_avg_sq)]
    assert cal.measure_adamw_out_of_place_s(state, 1, repeats=2) > 0
    assert all(np.array_equal(a, b) for a, b in zip(before, (state.param, state.exp_avg, state.exp_avg_sq)))
    new_param = state._spare[0]
    assert not np.array_equal(new_param, state.param)
    state.step(1)  # in place: the same update lands on the inputs
    assert np.array_equal(new_param, state.param)


def test_copies_are_timed_while_the_cpu_adamw_runs(monkeypatch):
    """The measurement behind duplex_contended_fraction: the duplex copy is timed while the AdamW steps
    run on a thread of their own, which has stopped when it returns."""
    state = cal.AdamwState(1 << 16)
    steps, timed_during = [], []
    monkeypatch.setattr(state, "step", lambda threads: steps.append(threads) or time.sleep(0.001))
    monkeypatch.setattr(cal, "measure_duplex_s", lambda buffers, repeats: timed_during.append(len(steps)) or 0.5)
    assert cal.measure_duplex_contended_s(state, 3, buffers=None, repeats=2) == 0.5
    assert timed_during[0] > 0 and set(steps) == {3}  # AdamW was under way when the copies were timed
    n = len(steps)
    time.sleep(0.01)
    assert len(steps) == n  # and stopped after


def test_the_cpu_adamw_is_timed_while_copies_run_throughout(monkeypatch):
    """The measurement behind cpu_adamw_contended_fraction and cpu_adamw_backward_fraction: copies
    both ways run, requeued, for as long as the AdamW's adaptive timing lasts (copies queued in advance end
    before it: 0.93 on an H100 host for 0.70), and stop after."""
    buffers = cal.CopyBuffers(torch.device("cpu"), 1 << 12)
    copies, seen = [], []
    monkeypatch.setattr(buffers, "h2d", lambda: copies.append("h2d"))
    monkeypatch.setattr(buffers, "d2h", lambda: copies.append("d2h") or time.sleep(0.001))
    state = cal.AdamwState(1 << 12)

    def timed(fn, cuda, *, repeats, label=None):
        for _ in range(20):  # the adaptive timing's calls, each seeing copies made since the last
            before = len(copies)
            fn()
            time.sleep(0.005)
            seen.append(len(copies) - before)
        return 0.25

    monkeypatch.setattr(cal, "_time_s", timed)
    assert cal.measure_adamw_contended_s(state, 1, buffers, repeats=3) == 0.25
    assert all(n > 0 for n in seen)  # copies ran beside every call, the last included
    n = len(copies)
    time.sleep(0.01)
    assert len(copies) == n  # and stopped after


def test_profile_round_trips_and_plans(quick_cpu, tmp_path):
    hw, _ = quick_cpu
    path = tmp_path / "hardware.json"
    hw.save(path)
    assert Hardware.load(path) == hw
    plan = slidedp.plan(make_model("qwen3"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu",
                        hardware=str(path))
    assert plan.hardware == hw.to_dict() and plan.hardware["name"] == "calibrated:cpu"
    assert plan.predicted_step_time_s > 0
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_cli_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    hw = Hardware.load(out)
    assert hw.name == "calibrated:cpu"
    printed = capsys.readouterr().out
    assert "H2D by size" in printed and "CPU AdamW" in printed and str(out) in printed
    assert "{" not in printed and "spread" in printed  # the JSON is in the file only; a human summary here
    assert json.loads(out.read_text()) == hw.to_dict()


def test_cli_calibrate_measures_the_block_of_a_given_model(tmp_path, capsys):
    """--model: the block efficiency is measured on that model's decoder block (here a preset's)."""
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--model", "llama-tiny", "--seq-len", "64",
                 "--out", str(out)]) == 0
    assert "block fwd+bwd   Qwen3 hidden 64, 1x64 tokens" in capsys.readouterr().out
    assert Hardware.load(out).block_efficiency > 0
    with pytest.raises(SystemExit, match="--seq-len goes with --model"):
        main(["calibrate", "--quick", "--device", "cpu", "--seq-len", "64", "--out", str(out)])


def test_measure_gives_median_and_spread_and_warns_when_unstable(monkeypatch, caplog):
    """Median and IQR/median from adaptive repeats (at least 4 blocks); a spread over 10% is warned once."""
    import itertools
    import time as _time

    from slidedp import logs

    t = cal.measure(lambda: sum(range(2000)), False, label="sum", max_run_s=0.2)
    assert t.median_s > 0 and t.spread >= 0 and t.calls >= 4
    monkeypatch.setattr(logs, "_warned", set())
    flip = itertools.cycle((1e-4, 4e-3))  # alternately fast and slow: a large spread whatever the repeats

    def noisy():
        _time.sleep(next(flip))

    timings = cal.Timings(max_run_s=0.15)
    for _ in range(2):
        timings.add(cal.measure(noisy, False, label="noisy", max_run_s=0.15))
    assert timings.unstable() and all(t.spread > cal.SPREAD_WARN for t in timings.unstable())
    said = [r.getMessage() for r in caplog.records if "noisy varied by" in r.getMessage()]
    assert len(said) == 1, said


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell 1 thread from the caller's")
def test_measure_runs_at_the_callers_torch_threads():
    """The Timer runs `fn` at the torch thread count the caller set (its own default is 1), or at num_threads."""
    before = torch.get_num_threads()
    seen = set()
    try:
        torch.set_num_threads(2)
        cal.measure(lambda: seen.add(torch.get_num_threads()), False, label="threads", max_run_s=0.05)
        assert seen == {2}
        seen.clear()
        cal.measure(lambda: seen.add(torch.get_num_threads()), False, label="threads", max_run_s=0.05, num_threads=1)
        assert seen == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="CUDA is not available"):
        cal.calibrate(device="cuda", quick=True)
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.gpu
@needs_cuda
def test_quick_cuda_calibration(tmp_path):
    lines = []
    hw = cal.calibrate(device="cuda", quick=True, progress=lines.append)
    assert hw.name.startswith("calibrated:") and hw.gpu_memory_bytes > 2**30
    assert hw.matmul_flops_per_s > 1e12 and 0 < hw.block_efficiency <= 1.5
    assert 1e9 <= hw.h2d_bytes_per_s <= 1e12 and 1e9 <= hw.d2h_bytes_per_s <= 1e12
    assert hw.duplex_bytes_per_s >= 0.5 * min(hw.h2d_bytes_per_s, hw.d2h_bytes_per_s)
    assert 0 < hw.cpu_adamw_contended_fraction <= 1 and 0 < hw.duplex_contended_fraction <= 1
    assert "duplex_contended_fraction" in "\n".join(lines)
    assert 0 < hw.cpu_adamw_backward_fraction <= 1 and "cpu_adamw_backward_fraction" in "\n".join(lines)
    assert hw.gpu_p2p_bytes_per_s >= 0
    assert 1e11 <= hw.gpu_memory_bytes_per_s <= 2e13
    assert 0 < hw.host_compiled_fwd_s < 0.05 and 0 < hw.host_compiled_bwd_s < 0.05
    assert "host_compiled_fwd_s" in "\n".join(lines)
    assert all(0 < f <= 1 for _, f in hw.transfer_efficiency)
    path = tmp_path / "hardware.json"
    hw.save(path)
    assert Hardware.load(path) == hw
    print("\n".join(lines))


# -- step fits -------------------------------------------------------------------------------------


def test_step_fits_take_exactly_the_step_fitted_coefficients_of_the_preset():
    from dataclasses import fields

    from slidedp.costmodel.hardware import STEP_FITTED, with_step_fits

    measured = PRESETS["rtx4090"]  # stands in for a calibrated profile
    fitted = with_step_fits(measured, "h200-sxm")
    assert fitted.name == "rtx4090 + h200-sxm step fits"
    for f in fields(measured):
        if f.name in STEP_FITTED:
            assert getattr(fitted, f.name) == getattr(PRESETS["h200-sxm"], f.name), f.name
        elif f.name != "name":
            assert getattr(fitted, f.name) == getattr(measured, f.name), f.name  # the machine's own
    with pytest.raises(ValueError, match="unknown preset 'tpu'"):
        with_step_fits(measured, "tpu")


def test_calibrate_cli_applies_the_step_fits_and_saves_them(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cal, "calibrate", lambda **kw: PRESETS["rtx4090"])  # the measurements, stood in
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--device", "cpu", "--step-fits", "h200-sxm", "--out", str(out)]) == 0
    saved = Hardware.load(out)
    assert saved.name.endswith("+ h200-sxm step fits") and saved.compiled_block_efficiency == 0.652
    assert "step fits       from h200-sxm" in capsys.readouterr().out
    assert main(["calibrate", "--device", "cpu", "--out", str(out)]) == 0  # without: the measurements alone
    assert Hardware.load(out) == PRESETS["rtx4090"]


def test_step_fits_scale_the_compiled_block_rate_by_the_models_block():
    """with_step_fits(block_ratio=r): the fitted compiled_block_efficiency times r, said in the name; the
    other step fits as without; a ratio that is not a positive number is refused."""
    from slidedp.costmodel.hardware import STEP_FITTED, with_step_fits

    measured = PRESETS["rtx4090"]
    plain, scaled = with_step_fits(measured, "h200-sxm"), with_step_fits(measured, "h200-sxm", block_ratio=0.8,
                                                                         block="qwen3-1.7b")
    assert scaled.compiled_block_efficiency == pytest.approx(0.652 * 0.8)
    assert scaled.name == "rtx4090 + h200-sxm step fits, compiled blocks x0.800 (qwen3-1.7b)"
    assert all(getattr(scaled, f) == getattr(plain, f) for f in STEP_FITTED if f != "compiled_block_efficiency")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="block_ratio"):
            with_step_fits(measured, "h200-sxm", block_ratio=bad, block="x")


def test_rest_rate_takes_attention_apart():
    shape = cal.BlockShape(64, 96, 4, 2, 16, seq_len=32)
    fwd, bwd = cal.count_block_flops_fwd_bwd(shape, torch.float32)
    att_fwd, att_bwd = cal.attention_flops_fwd_bwd(shape)
    assert cal.rest_flops_per_s(shape, 2.0, 2, 0.0, False) == pytest.approx((2 * fwd + bwd) / 2.0)
    rate = 1e9
    assert cal.rest_flops_per_s(shape, 2.0, 2, rate, False) == pytest.approx(
        (2 * fwd + bwd - 2 * att_fwd - att_bwd) / (2.0 - (2 * att_fwd + att_bwd) / rate))


def test_block_rate_ratio_times_both_blocks_here():
    """The model's block against the fitted one, both timed on this machine (eager on the CPU): the same
    block is 1 without timing anything; a block of other sizes gives a positive rate ratio."""
    small, other = cal.BlockShape(64, 96, 4, 2, 16, seq_len=32), cal.BlockShape(128, 256, 4, 2, 32, seq_len=32)
    assert cal.block_rate_ratio(model_shape=small, reference_shape=small, device="cpu") == 1.0
    lines = []
    ratio = cal.block_rate_ratio(model_shape=other, reference_shape=small, device="cpu", quick=True,
                                 progress=lines.append)
    assert math.isfinite(ratio) and ratio > 0
    assert [line.split()[:2] for line in lines] == [["block", "rate"], ["block", "rate"], ["block", "ratio"]]


def test_cli_scales_the_step_fits_by_the_models_block_on_a_base_profile(monkeypatch, tmp_path, capsys):
    """--model with --step-fits: the compiled block rate is the fit's times the measured ratio; with --base
    only the blocks are timed and the rest is the machine's saved profile (its own, not another's)."""
    base = tmp_path / "cpu.json"
    mine = Hardware.from_dict({**PRESETS["rtx4090"].to_dict(), "name": "calibrated:cpu"})
    mine.save(base)
    shapes = []
    monkeypatch.setattr(cal, "block_rate_ratio", lambda **kw: shapes.append(kw["model_shape"]) or 0.75)
    monkeypatch.setattr(cal, "calibrate", lambda **kw: pytest.fail("--base measures nothing else"))
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--device", "cpu", "--model", "qwen3-1.7b", "--step-fits", "h200-sxm",
                 "--base", str(base), "--out", str(out)]) == 0
    saved = Hardware.load(out)
    assert saved.compiled_block_efficiency == pytest.approx(0.652 * 0.75)
    assert saved.name == "calibrated:cpu + h200-sxm step fits, compiled blocks x0.750 (qwen3-1.7b)"
    assert saved.h2d_bytes_per_s == mine.h2d_bytes_per_s  # the base's measurements
    assert shapes[0].hidden_size == 2048 and "times 0.7500" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--base goes with --model and --step-fits"):
        main(["calibrate", "--device", "cpu", "--step-fits", "h200-sxm", "--base", str(base), "--out", str(out)])
    Hardware.from_dict({**mine.to_dict(), "name": "calibrated:NVIDIA H100 80GB HBM3"}).save(base)
    with pytest.raises(SystemExit, match="not the measurements of this machine"):
        main(["calibrate", "--device", "cpu", "--model", "qwen3-1.7b", "--step-fits", "h200-sxm",
              "--base", str(base), "--out", str(out)])


# -- the host's floor of a compiled block ---------------------------------------------------------


def test_the_engines_host_time_per_block_is_timed_in_its_steps():
    """measure_engine_block_host_s: the host's time in the blocks' forward and backward ops of a narrow
    model's steps, per block and micro-batch (on the CPU the blocks' compute is the host's too)."""
    fwd, bwd = cal.measure_engine_block_host_s(torch.device("cpu"), layers=2, micro_batches=2, steps=1)
    assert 0 < fwd < 1 and 0 < bwd < 1


def test_the_host_floor_names_a_numbered_cuda_device_as_compile_takes_it(monkeypatch):
    """calibrate resolves "cuda" to cuda:0; the engine it compiles for the floor is asked for "cuda"
    (slidedp.compile takes "auto", "cuda" or "cpu")."""
    from slidedp import api

    seen = {}

    def compile_(model, budget, **kw):
        seen.update(kw)
        raise RuntimeError("compiled")

    monkeypatch.setattr(api, "compile", compile_)
    with pytest.raises(RuntimeError, match="compiled"):
        cal.measure_engine_block_host_s(torch.device("cuda", 0))
    assert seen["device"] == "cuda"


def test_a_failed_host_floor_measurement_leaves_no_floor_and_says_so(monkeypatch, caplog):
    """compiled_host_floor: the measurement's numbers, said; where the engine's run fails, a warning
    naming the error and (0, 0), not a lost profile."""
    from slidedp import logs

    monkeypatch.setattr(logs, "_warned", set())
    lines = []
    monkeypatch.setattr(cal, "measure_engine_block_host_s", lambda device: (1e-3, 2e-3))
    assert cal.compiled_host_floor(torch.device("cpu"), lines.append) == (1e-3, 2e-3)
    assert "host_compiled_fwd_s" in lines[0]

    def fail(device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cal, "measure_engine_block_host_s", fail)
    with caplog.at_level("WARNING", logger="slidedp"):
        assert cal.compiled_host_floor(torch.device("cpu"), lines.append) == (0.0, 0.0)
    assert "RuntimeError: no compiler here" in caplog.text and len(lines) == 1


def test_host_only_calibration_keeps_the_gpu_and_measures_the_host(tmp_path, capsys):
    """`slidedp calibrate --host-only PROFILE`: PROFILE's GPU figures, this host's CPU AdamW and DRAM
    measured (the CPU device: the shares beside copies and the compiled floor stay PROFILE's); named once."""
    from slidedp.costmodel.hardware import HOST_FIELDS, with_host

    base = PRESETS["h100-sxm"]
    out = tmp_path / "host.json"
    assert main(["calibrate", "--host-only", "h100-sxm", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    host = Hardware.load(out)
    assert host.name == "h100-sxm, host re-measured"
    gpu_fields = set(Hardware.__dataclass_fields__) - set(HOST_FIELDS) - {"name"}
    assert all(getattr(host, f) == getattr(base, f) for f in gpu_fields)
    assert host.cpu_adamw_params_per_s != base.cpu_adamw_params_per_s and host.cpu_cores == (os.cpu_count() or 1)
    assert host.cpu_adamw_params_per_s == max(r for _, r in host.cpu_adamw_params_per_s_by_threads)
    for field in ("cpu_adamw_contended_fraction", "cpu_adamw_backward_fraction", "duplex_contended_fraction",
                  "host_compiled_fwd_s", "host_compiled_bwd_s"):
        assert getattr(host, field) == getattr(base, field)
    again = with_host(host, host)
    assert again.name == host.name and again == host  # the suffix once
    with pytest.raises(SystemExit, match="--host-only measures only the host"):
        main(["calibrate", "--host-only", "h100-sxm", "--model", "4b", "--out", str(out)])
    with pytest.raises(SystemExit, match="unknown hardware"):
        main(["calibrate", "--host-only", "no-such-gpu", "--out", str(out)])
