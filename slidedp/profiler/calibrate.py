"""Measure the running machine into a `Hardware` profile (`slidedp calibrate`).

One function per measurement: each warms up, then torch.utils.benchmark's adaptive_autorange times
blocks of calls until their spread (IQR / median) is under 10% or a time limit passes, and keeps the
median; a measurement whose spread stays above 10% is warned about once (`Timings`). The pure
helpers at the top turn those timings into the profile's fields (rates, the transfer-efficiency
curve, AdamW by threads) and are what the tests check exactly, on synthetic timings.

On CUDA: bf16 matmuls and a bf16 transformer block on GPU 0, pinned-host <-> GPU copies timed with
CUDA events, the CPU AdamW alone and while copies run both ways, GPU-to-GPU copies when a second
GPU is visible. Without CUDA (or `device="cpu"`) the CPU "device" is measured the way the CPU
backend runs: compute on the host in fp32, and "H2D"/"D2H" are memcpy between two host tensors,
run in order (so both directions "at once" share one copy engine: the cores).

`torch.cuda` is only touched inside functions, and only on the CUDA path.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import timeit
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch
from torch.utils import benchmark
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from slidedp.backend.kernels.cpu_adamw import adamw_step, get_num_threads
from slidedp.backend.runtime.block_runner import run_block
from slidedp.backend.state.device_state import adamw_piece_
from slidedp.costmodel.hardware import Hardware, with_host
from slidedp.costmodel.ops import DEVICE_ADAMW_BYTES_PER_PARAM, transfer_efficiency
from slidedp.ir.export_trace import EXTRA_FLOP_FORMULAS, attention_flops
from slidedp.logs import warn_once
from slidedp.optim import AdamW

KiB, MiB, GiB = 2**10, 2**20, 2**30

Progress = Callable[[str], None]
T = TypeVar("T")

# -- pure helpers: timings -> profile fields ------------------------------------------------------


def median_s(times_s: Sequence[float]) -> float:
    """Median of repeated timings [s]; refuses empty or non-positive timings."""
    if not times_s or any(not t > 0 for t in times_s):
        raise ValueError(f"timings must be positive seconds, got {list(times_s)!r}")
    return float(statistics.median(times_s))


def transfer_profile(samples: Sequence[tuple[int, float]]) -> tuple[float, tuple[tuple[int, float], ...]]:
    """From (bytes, seconds per copy) samples: the large-copy rate [bytes/s] and the efficiency curve.

    rate(s) = s / t(s); the large-copy rate R = max_s rate(s); the curve is (s, rate(s) / R) by
    increasing s, so fractions lie in (0, 1] and `R * transfer_efficiency(s, curve)` gives back the
    measured rate at every measured size (ops.transfer_time_s reproduces each measurement).
    """
    points = sorted((int(nbytes), float(seconds)) for nbytes, seconds in samples)
    if not points or any(b <= 0 or not t > 0 for b, t in points):
        raise ValueError(f"transfer samples must be (bytes > 0, seconds > 0) pairs, got {list(samples)!r}")
    if any(a[0] == b[0] for a, b in zip(points, points[1:])):
        raise ValueError(f"transfer samples repeat a size: {[b for b, _ in points]}")
    rates = [(b, b / t) for b, t in points]
    peak = max(r for _, r in rates)
    return peak, tuple((b, min(1.0, r / peak)) for b, r in rates)


def large_copy_rate(nbytes: int, seconds: float, curve: tuple[tuple[int, float], ...]) -> float:
    """Bandwidth [bytes/s] that, through the efficiency curve, predicts this copy's time.

    B = nbytes / seconds / eff(nbytes): ops.transfer_time_s(nbytes, B, curve) == seconds.
    """
    if nbytes <= 0 or not seconds > 0:
        raise ValueError(f"need bytes > 0 and seconds > 0, got {nbytes}, {seconds}")
    return nbytes / seconds / transfer_efficiency(nbytes, curve)


def thread_counts(max_threads: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_threads, then max_threads itself."""
    if max_threads < 1:
        raise ValueError(f"max_threads must be >= 1, got {max_threads}")
    counts = [1 << k for k in range(max_threads.bit_length()) if 1 << k < max_threads]
    return tuple(counts + [max_threads])


def adamw_rates(numel: int, samples: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(threads, seconds per update of `numel` parameters) -> (threads, params/s) by increasing threads."""
    if numel <= 0 or not samples or any(t < 1 or not s > 0 for t, s in samples):
        raise ValueError(f"need numel > 0 and (threads >= 1, seconds > 0) samples, got {numel}, {list(samples)!r}")
    return tuple((int(t), numel / s) for t, s in sorted(samples))


def fraction_kept(rate: float, reference: float) -> float:
    """Fraction of a reference rate kept under contention: min(1, rate / reference) (noise stays <= 1)."""
    if not rate > 0 or not reference > 0:
        raise ValueError(f"rates must be positive, got {rate}, {reference}")
    return min(1.0, rate / reference)


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units for the progress lines: 65536 -> '64 KiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


# -- what to measure at which size -------------------------------------------------------------


@dataclass(frozen=True)
class BlockShape:
    """A Qwen3 decoder layer's shape and the tokens it runs on (batch_size x seq_len)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    seq_len: int
    batch_size: int = 1


QWEN3_4B_BLOCK = BlockShape(2560, 9728, 32, 8, 128, 4096)  # docs/design.md §6.2: 7.8 ms fwd+bwd on an H200


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repeats of one calibration (full or quick, CUDA or CPU)."""

    matmul_n: int
    block: BlockShape
    transfer_bytes: tuple[int, ...]  # increasing; the last is the "large copy"
    host_copy_bytes: int
    adamw_numel: int
    p2p_bytes: int
    repeats: int


def default_sizes(cuda: bool, quick: bool) -> Sizes:
    """Sizes for the device and mode: full ones as docs/design.md §6.2 measured them, quick ones small."""
    sweep = tuple(64 * KiB * 4**k for k in range(8))  # 64 KiB, 256 KiB, ..., 1 GiB
    if cuda and not quick:
        return Sizes(8192, QWEN3_4B_BLOCK, sweep, GiB, 2**27, GiB, 5)
    if cuda:  # matmul and block take milliseconds on a GPU: smaller ones would only misreport them
        return Sizes(8192, QWEN3_4B_BLOCK, sweep[:6], 256 * MiB, 2**24, 256 * MiB, 3)
    if not quick:
        return Sizes(1024, BlockShape(512, 1536, 8, 4, 64, 512), sweep, GiB, 2**27, 0, 5)
    # matmul of milliseconds even here: a shorter one is at the mercy of a single preempted thread
    return Sizes(768, BlockShape(128, 384, 4, 2, 32, 128), sweep[:5], 128 * MiB, 2**22, 0, 3)


# -- timing --------------------------------------------------------------------------------------


SPREAD_WARN = 0.10  # IQR / median above which a measurement is called unstable
# Seconds one measurement may take (torch.utils.benchmark's adaptive_autorange stops earlier once its
# IQR / median is under SPREAD_WARN): full and --quick calibrations.
MAX_RUN_S, QUICK_MAX_RUN_S = 2.0, 0.3


@dataclass(frozen=True)
class Timing:
    """One measurement: the median seconds of a call, the spread (IQR / median) and the calls timed."""

    label: str
    median_s: float
    spread: float
    calls: int


class Timings:
    """Every measurement of one calibration, and a warning for each whose spread is large."""

    def __init__(self, max_run_s: float = MAX_RUN_S, say: Progress | None = None):
        self.max_run_s, self.say, self.all = max_run_s, say, []

    def add(self, t: Timing) -> None:
        self.all.append(t)
        if t.spread > SPREAD_WARN:
            warn_once(("calibrate", t.label, id(self)),
                      "calibrate: %s varied by %.0f%% (IQR/median over %d calls, median %.4g ms): the machine may "
                      "be busy; its figure is rougher, calibrate again on an idle machine", t.label, 100 * t.spread,
                      t.calls, t.median_s * 1e3)

    def unstable(self) -> list[Timing]:
        return [t for t in self.all if t.spread > SPREAD_WARN]


_timings = Timings()  # where _time_s records (calibrate() installs its own)


def measure(fn: Callable[[], None], cuda: bool, *, label: str, warmup: int = 1,
            max_run_s: float = MAX_RUN_S, num_threads: int | None = None) -> Timing:
    """Median and spread of `fn()` by torch.utils.benchmark's adaptive_autorange: blocks of calls
    are timed until their IQR / median is under SPREAD_WARN (at least 4 blocks) or `max_run_s` has
    passed. On CUDA the timer synchronizes the device; otherwise wall clock alone (so that copies
    running on the device beside it, as the contended AdamW measurement wants, are not waited for).
    num_threads: torch's intra-op threads while timing; default torch.get_num_threads() at the call,
    the count the caller set (the Timer's own default would run `fn` on 1 thread)."""
    threads = torch.get_num_threads() if num_threads is None else num_threads
    with benchmark.utils.common.set_torch_threads(threads):
        for _ in range(warmup):
            fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, label=label, num_threads=threads,
                            **({} if cuda else {"timer": timeit.default_timer}))
    m = timer.adaptive_autorange(threshold=SPREAD_WARN, min_run_time=min(0.05, max_run_s), max_run_time=max_run_s)
    calls = m.number_per_run * len(m.raw_times)
    return Timing(label, median_s([m.median]), float(m.iqr / m.median) if m.median > 0 else 0.0, calls)


def _time_s(fn: Callable[[], None], cuda: bool, *, repeats: int, warmup: int = 1, label: str | None = None) -> float:
    """Median seconds of `fn()` (`measure`), recorded with its spread in the calibration's Timings.
    `repeats` is kept for the callers' signatures: the number of calls is adaptive now."""
    del repeats
    t = measure(fn, cuda, label=label or getattr(fn, "__name__", "measurement"), warmup=warmup,
                max_run_s=_timings.max_run_s)
    _timings.add(t)
    return t.median_s


# -- measurements ----------------------------------------------------------------------------------


def measure_matmul_flops_per_s(device: torch.device, n: int, *, repeats: int) -> float:
    """Dense matmul rate [FLOP/s]: n x n @ n x n (2 n^3 FLOPs), bf16 on CUDA, fp32 on the CPU."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _time_s(lambda: torch.mm(a, b, out=out), cuda, repeats=max(repeats, 5), warmup=2, label="matmul")
    return 2.0 * n**3 / seconds


def qwen3_block_config(shape: BlockShape, num_hidden_layers: int = 1):
    """A Qwen3Config of the given block shape (one layer unless told), SDPA attention."""
    return Qwen3Config(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                       head_dim=shape.head_dim, num_hidden_layers=num_hidden_layers, vocab_size=128,
                       max_position_embeddings=shape.seq_len, attn_implementation="sdpa")


def count_block_flops(shape: BlockShape, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOPs of one forward + backward (input and parameter gradients) of a Qwen3 decoder layer
    (the sum of `count_block_flops_fwd_bwd`)."""
    return sum(count_block_flops_fwd_bwd(shape, dtype))


def count_block_flops_fwd_bwd(shape: BlockShape, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """FLOPs of one forward and of one backward (input and parameter gradients) of a Qwen3 decoder layer.

    Counted as slidedp.ir counts a block's flops_fwd + flops_bwd: FlopCounterMode with the IR's
    extra formulas, on fake CPU tensors (no memory, any shape), forward and backward under separate
    counters; so the IR's FLOPs divided by the rate measured with this count predict the block's
    time. No mask, as the executor runs a block without padding: SDPA is causal and counts half
    of the query-key pairs (slidedp.ir.export_trace.EXTRA_FLOP_FORMULAS).
    """
    with torch.device("meta"):
        layer = Qwen3DecoderLayer(qwen3_block_config(shape), layer_idx=0)
    tokens = (shape.batch_size, shape.seq_len)
    with FakeTensorMode():
        params = {name: torch.empty(p.shape, dtype=dtype, requires_grad=True) for name, p in layer.named_parameters()}
        hidden = torch.empty(*tokens, shape.hidden_size, dtype=dtype, requires_grad=True)
        rotary = (torch.empty(*tokens, shape.head_dim, dtype=dtype), torch.empty(*tokens, shape.head_dim, dtype=dtype))
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fwd_counter:
            out = torch.func.functional_call(layer, params, (hidden,),
                                             dict(attention_mask=None, position_embeddings=rotary))
            out = out[0] if isinstance(out, tuple) else out
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as bwd_counter:
            torch.autograd.grad(out, [hidden, *params.values()], torch.ones_like(out))
    return float(fwd_counter.get_total_flops()), float(bwd_counter.get_total_flops())


def measure_block_fwd_bwd_s(device: torch.device, shape: BlockShape, *, repeats: int, compiled: bool = False) -> float:
    """Seconds of one forward + backward of a Qwen3 decoder layer (causal SDPA, no mask), computing
    the gradients of the input and of every parameter; bf16 on CUDA, fp32 on the CPU.

    compiled: as the executor runs a recomputed block with `compile_blocks` instead: the forward
    without autograd, then forward and backward, each through `torch.compile` (compiled before the
    timing)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = qwen3_block_config(shape)
    with torch.device(device):
        layer = Qwen3DecoderLayer(config, layer_idx=0).to(dtype)
        rotary = Qwen3RotaryEmbedding(config)
        hidden = torch.randn(shape.batch_size, shape.seq_len, shape.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(shape.seq_len)[None].expand(shape.batch_size, -1)
        grad_out = torch.randn_like(hidden)
    with torch.no_grad():
        cos, sin = rotary(hidden, positions)
    inputs = [hidden, *layer.parameters()]
    params = dict(layer.named_parameters())
    kwargs = dict(attention_mask=None, position_embeddings=(cos, sin))
    block = torch.compile(run_block, dynamic=False) if compiled else run_block

    def step():
        if compiled:
            with torch.no_grad():
                block(layer, params, (hidden,), kwargs)
        out = block(layer, params, (hidden,), kwargs)
        torch.autograd.grad(out[0] if isinstance(out, tuple) else out, inputs, grad_out)

    if compiled:
        step()  # compile outside the timing
    return _time_s(step, cuda, repeats=repeats, label="block fwd+bwd")


def measure_engine_block_host_s(device: torch.device, *, layers: int = 8, micro_batches: int = 4,
                                steps: int = 3) -> tuple[float, float]:
    """(forward, backward) seconds the engine's host takes to issue one block for one micro-batch: a
    narrow Qwen3 model (head size 128, hidden 256) trained by slidedp (blocks compiled on CUDA) for
    `steps` steps after two warm-up ones; its kernels are short enough that the device keeps up, so the
    time in the blocks' forward and backward ops is the host's (the executor's work and the compiled
    calls; `StreamedExecutor.block_issue_s`), a recomputed block's second forward taken out of its
    backward."""
    from transformers import Qwen3ForCausalLM

    from slidedp import api

    cuda = device.type == "cuda"
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=128, num_hidden_layers=layers, vocab_size=1024, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    engine = api.compile(model, "8GiB" if cuda else "1GiB", batch_size=1, seq_len=256, device=device.type,
                         micro_batches=micro_batches, compile_blocks=cuda, optimizer=AdamW(lr=1e-5))
    try:
        blocks = [d for d in engine.plan.decisions if d.layer_id not in (0, len(engine.plan.decisions) - 1)]
        recomputed = sum(d.activation.startswith("recompute") for d in blocks)
        ids = torch.randint(0, config.vocab_size, (micro_batches, 256))
        issued = engine.executor.block_issue_s
        per_step = []
        for k in range(steps + 2):
            before = dict(issued)
            engine.step(ids)
            if k >= 2:  # the first steps compile
                per_step.append({kind: issued[kind] - before[kind] for kind in issued})
        fwd = statistics.median(s["fwd"] for s in per_step) / (len(blocks) * micro_batches)
        bwd = statistics.median(s["bwd"] for s in per_step) / (len(blocks) * micro_batches)
        bwd -= fwd * recomputed / len(blocks)  # a recomputed block's backward issues its forward again
    finally:
        engine.close()
    return fwd, max(bwd, 0.0)


def compiled_host_floor(device: torch.device, say: Progress) -> tuple[float, float]:
    """measure_engine_block_host_s, said; where it fails (a model the engine cannot compile or run here),
    a warning and no floor (0, 0) rather than no profile."""
    try:
        fwd, bwd = measure_engine_block_host_s(device)
    except Exception as e:  # noqa: BLE001 - any failure of the engine's run: the rest of the profile stands
        warn_once(("calibrate", "compiled host"), "slidedp calibrate: the engine's host time per block was not "
                  "measured (%s: %s); host_compiled_fwd_s and host_compiled_bwd_s stay 0 (no floor)", type(e).__name__, e)
        return 0.0, 0.0
    say(f"compiled host   the engine issuing a narrow model's compiled blocks: forward {fwd * 1e3:.3g} ms, "
        f"backward {bwd * 1e3:.3g} ms a block and micro-batch, host_compiled_fwd_s / _bwd_s")
    return fwd, bwd


def rest_flops_per_s(shape: BlockShape, seconds: float, forwards: int, attention_flops_per_s: float,
                     cuda: bool) -> float:
    """The rate of a block's FLOPs but attention's: `forwards` forwards and one backward took `seconds`,
    less the attention's time at `attention_flops_per_s` (0: not measured, the whole block's rate)."""
    flops_fwd, flops_bwd = count_block_flops_fwd_bwd(shape, torch.bfloat16 if cuda else torch.float32)
    flops = forwards * flops_fwd + flops_bwd
    if not attention_flops_per_s:
        return flops / seconds
    attention_fwd, attention_bwd = attention_flops_fwd_bwd(shape)
    att = forwards * attention_fwd + attention_bwd
    return (flops - att) / max(seconds - att / attention_flops_per_s, 0.1 * seconds)


def block_rate_ratio(*, model_shape: BlockShape, reference_shape: BlockShape = QWEN3_4B_BLOCK, device: str = "auto",
                     attention_flops_per_s: float = 0.0, quick: bool = False, progress: Progress | None = None) -> float:
    """The rate of `model_shape`'s block over `reference_shape`'s (the block a preset's step fits were
    fitted on), both timed here as a step runs them: compiled on CUDA (forward, then recompute and
    backward), eager on the CPU; attention's FLOPs apart at `attention_flops_per_s` (0: whole blocks).
    A preset's step-fitted compiled_block_efficiency times this ratio is the model's block's
    (costmodel.hardware.with_step_fits): the fit gives the level a block reaches inside a step, the
    ratio how the model's block sizes differ from the fitted one's on this machine."""
    if model_shape == reference_shape:
        return 1.0
    say = progress or (lambda line: None)
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    repeats = default_sizes(cuda, quick).repeats
    rates = []
    for shape in (model_shape, reference_shape):
        seconds = measure_block_fwd_bwd_s(dev, shape, repeats=repeats, compiled=cuda)
        rates.append(rest_flops_per_s(shape, seconds, 2 if cuda else 1, attention_flops_per_s, cuda))
        say(f"block rate      hidden {shape.hidden_size}, intermediate {shape.intermediate_size}, "
            f"{shape.batch_size}x{shape.seq_len} tokens, {'compiled' if cuda else 'eager'}: {seconds * 1e3:.4g} ms, "
            f"{rates[-1] / 1e12:.4g} TFLOP/s" + (" (but attention)" if attention_flops_per_s else ""))
        if cuda:
            torch.cuda.empty_cache()
    say(f"block ratio     {rates[0] / rates[1]:.4f} (the model's block over the step fits' block)")
    return rates[0] / rates[1]


def attention_flops_fwd_bwd(shape: BlockShape) -> tuple[int, int]:
    """FLOPs of the block's causal attention, forward and backward, as slidedp.ir counts them."""
    q = (shape.batch_size, shape.num_attention_heads, shape.seq_len, shape.head_dim)
    kv = (shape.batch_size, shape.num_key_value_heads, shape.seq_len, shape.head_dim)
    return attention_flops(q, kv, kv, True, backward=False), attention_flops(q, kv, kv, True, backward=True)


def measure_attention_s(device: torch.device, shape: BlockShape, *, repeats: int) -> tuple[float, float]:
    """Seconds of the block's causal SDPA (grouped-query heads) forward alone, and of forward +
    backward (gradients of query, key and value); bf16 on CUDA, fp32 on the CPU."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    b, s, d = shape.batch_size, shape.seq_len, shape.head_dim
    q = torch.randn(b, shape.num_attention_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, shape.num_key_value_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        forward_s = _time_s(forward, cuda, repeats=repeats, label="attention fwd")
    return forward_s, _time_s(lambda: torch.autograd.grad(forward(), (q, k, v), grad), cuda, repeats=repeats,
                               label="attention fwd+bwd")


class CopyBuffers:
    """The four buffers of the copy measurements, `nbytes` each.

    CUDA: pinned host source and destination, device source and destination. CPU: four host
    tensors (the CPU backend's "device" memory is host memory).
    """

    def __init__(self, device: torch.device, nbytes: int):
        self.cuda = device.type == "cuda"
        self.nbytes = nbytes
        pin = self.cuda
        self.host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).fill_(1)
        self.host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).fill_(2)
        self.dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
        self.dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(4)

    def h2d(self, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.nbytes if nbytes is None else nbytes
        self.dev_dst[offset:offset + n].copy_(self.host_src[offset:offset + n], non_blocking=self.cuda)

    def d2h(self, offset: int = 0, nbytes: int | None = None) -> None:
        n = self.nbytes if nbytes is None else nbytes
        self.host_dst[offset:offset + n].copy_(self.dev_src[offset:offset + n], non_blocking=self.cuda)


def measure_h2d_by_size(buffers: CopyBuffers, sizes: Sequence[int], *, repeats: int,
                        max_copies: int = 64) -> list[tuple[int, float]]:
    """(bytes, seconds per copy) of H2D copies of each size.

    A repeat is k = min(max_copies, buffer // size) copies back to back over successive disjoint
    slices (cold data on the CPU, as streamed weights are), timed together and divided by k.
    """
    samples = []
    for size in sizes:
        if size > buffers.nbytes:
            raise ValueError(f"transfer size {size} exceeds the {buffers.nbytes}-byte buffers")
        k = max(1, min(max_copies, buffers.nbytes // size))

        def batch(size=size, k=k):
            for i in range(k):
                buffers.h2d(i * size, size)

        samples.append((size, _time_s(batch, buffers.cuda, repeats=repeats,
                                              label=f"H2D {format_bytes(size)}") / k))
    return samples


def measure_d2h_s(buffers: CopyBuffers, *, repeats: int) -> float:
    """Seconds of one D2H copy of the whole buffer (pinned destination on CUDA)."""
    return _time_s(buffers.d2h, buffers.cuda, repeats=repeats, label="D2H")


def measure_duplex_s(buffers: CopyBuffers, *, repeats: int) -> float:
    """Seconds to move the whole buffer both ways: an H2D and a D2H copy at once [s].

    CUDA: the two copies on two streams, started together; timed until both end. CPU: the two
    memcpy one after the other, as the CPU backend runs its copy "streams" in order.
    """
    if not buffers.cuda:
        return _time_s(lambda: (buffers.h2d(), buffers.d2h()), False, repeats=repeats, label="duplex")
    current, up, down = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        for stream, copy in ((up, buffers.h2d), (down, buffers.d2h)):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                copy()
        current.wait_stream(up)
        current.wait_stream(down)

    return _time_s(both, True, repeats=repeats, label="duplex")


def measure_host_dram_bytes_per_s(nbytes: int, *, repeats: int) -> float:
    """Host memory bandwidth [bytes/s]: torch copy_ of `nbytes` on all cores, counting read + write (2 x nbytes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.zeros_like(src)
        seconds = _time_s(lambda: dst.copy_(src), False, repeats=repeats, label="host DRAM copy")
    finally:
        torch.set_num_threads(threads)
    return 2.0 * src.numel() * 4 / seconds


class AdamwState:
    """Flat AdamW state of `numel` parameters as the bf16 path keeps it: fp32 param and moments,
    bf16 gradient in, bf16 weights out (bfloat16 as uint16 bit patterns)."""

    def __init__(self, numel: int):
        self.numel = numel
        self.param = np.full(numel, 0.02, dtype=np.float32)
        self.grad = np.full(numel, 0x3C23, dtype=np.uint16)  # bf16 bits of about 0.01
        self.exp_avg = np.zeros(numel, dtype=np.float32)
        self.exp_avg_sq = np.zeros(numel, dtype=np.float32)
        self.out_bf16 = np.empty(numel, dtype=np.uint16)
        self._spare: tuple[np.ndarray, ...] | None = None

    def step(self, num_threads: int, out_of_place: bool = False) -> None:
        """One update in place, or out of place (into spare arrays, as an early update writes its
        layer's new state beside the old one: backend/runtime/early_updates.py)."""
        if out_of_place and self._spare is None:
            self._spare = tuple(np.zeros(self.numel, dtype=np.float32) for _ in range(3))
        adamw_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.out_bf16, lr=1e-4, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, num_threads=num_threads,
                   to=self._spare if out_of_place else None)


def measure_adamw_s(state: AdamwState, threads: Sequence[int], *, repeats: int) -> list[tuple[int, float]]:
    """(threads, seconds) of slidedp's CPU AdamW (`backend.kernels.cpu_adamw.adamw_step`, bf16 grad in and
    bf16 weights out) over the whole state, for each thread count."""
    torch_threads = torch.get_num_threads()  # Numba's OpenMP pool may share torch's setting
    try:
        return [(t, _time_s(lambda t=t: state.step(t), False, repeats=repeats,
                                 label=f"CPU AdamW {t} threads")) for t in threads]
    finally:
        torch.set_num_threads(torch_threads)


def measure_adamw_out_of_place_s(state: AdamwState, threads: int, *, repeats: int) -> float:
    """Seconds of the CPU AdamW on `threads` threads writing its result beside its inputs (as the early
    updates do), with nothing else running."""
    state.step(threads, out_of_place=True)  # the spare arrays allocated and touched outside the timing
    torch_threads = torch.get_num_threads()
    try:
        return _time_s(lambda: state.step(threads, out_of_place=True), False, repeats=repeats,
                       label="CPU AdamW out of place")
    finally:
        torch.set_num_threads(torch_threads)


def measure_adamw_contended_s(state: AdamwState, threads: int, buffers: CopyBuffers, *, repeats: int,
                              out_of_place: bool = False) -> float:
    """Seconds of the CPU AdamW (as `measure_adamw_s`; `out_of_place`: as an early update writes it)
    while H2D and D2H copies run at once (CUDA), for as long as its timing lasts (`beside_copies`).

    Copies queued in advance end before the adaptive timing does, and most of its calls then run alone:
    0.93 of the AdamW's rate on an H100 host, where copies running throughout leave it 0.70
    (benchmarks/cpu_adamw/in_step.py) and a step's round of updates runs at 0.66."""
    torch_threads = torch.get_num_threads()
    try:
        seconds = beside_copies(buffers, lambda: _time_s(lambda: state.step(threads, out_of_place), False,
                                                          repeats=repeats, label="CPU AdamW contended"))
    finally:
        torch.set_num_threads(torch_threads)
    return seconds


def beside(loop: Callable[[threading.Event], None], fn: Callable[[], T], *, name: str, settle_s: float = 0.05) -> T:
    """`fn()` while `loop(stop)` runs on a thread of its own (started `settle_s` before `fn`), which must
    return once `stop` is set; it has returned when this does."""
    stop = threading.Event()
    worker = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    worker.start()
    try:
        time.sleep(settle_s)
        return fn()
    finally:
        stop.set()
        worker.join()


def beside_copies(buffers: CopyBuffers, fn: Callable[[], T]) -> T:
    """`fn()` while copies of the large buffers run both ways at once, requeued until `fn` returns (CUDA:
    two streams, a pair queued ahead of the one waited for; CPU: the copies one after the other)."""
    def pump(stop: threading.Event) -> None:
        if not buffers.cuda:
            while not stop.is_set():
                buffers.h2d()
                buffers.d2h()
            return
        up, down = torch.cuda.Stream(), torch.cuda.Stream()

        def queue() -> list[torch.cuda.Event]:
            ends = []
            for stream, copy in ((up, buffers.h2d), (down, buffers.d2h)):
                with torch.cuda.stream(stream):
                    copy()
                ends.append(torch.cuda.Event())
                ends[-1].record(stream)
            return ends

        pending = queue()
        while not stop.is_set():
            ahead = queue()
            for end in pending:
                end.synchronize()
            pending = ahead
        for end in pending:
            end.synchronize()

    return beside(pump, fn, name="slidedp-calibrate-copies")


def beside_adamw(state: AdamwState, threads: int, fn: Callable[[], T]) -> T:
    """`fn()` while the CPU AdamW runs on `threads` threads, over and over on a thread of its own (it
    has stopped when this returns)."""
    def hammer(stop: threading.Event) -> None:
        while not stop.is_set():
            state.step(threads)

    torch_threads = torch.get_num_threads()
    try:
        return beside(hammer, fn, name="slidedp-calibrate-adamw", settle_s=0.1)  # the AdamW under way
    finally:
        torch.set_num_threads(torch_threads)


def measure_duplex_contended_s(state: AdamwState, threads: int, buffers: CopyBuffers, *, repeats: int) -> float:
    """Seconds of the duplex copy (as `measure_duplex_s`, CUDA) beside the CPU AdamW (`beside_adamw`): the
    copies' share of host DRAM beside the optimizer."""
    return beside_adamw(state, threads, lambda: measure_duplex_s(buffers, repeats=repeats))


def measure_device_adamw_bytes_per_s(device: torch.device, numel: int, *, repeats: int) -> float:
    """Device memory bandwidth of the device's AdamW as slidedp runs it (backend/state/device_state.py's
    `adamw_piece_` on a bf16 gradient with clipping), as ops.DEVICE_ADAMW_BYTES_PER_PARAM bytes per
    parameter over the time."""
    master = torch.zeros(numel, dtype=torch.float32, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=device)
    steps, opt = [torch.tensor(1.0, device=device)], AdamW()
    seconds = _time_s(lambda: adamw_piece_(master, exp_avg, exp_avg_sq, grad, steps, opt, clip=0.5),
                      device.type == "cuda", repeats=repeats, label="device AdamW")
    return numel * DEVICE_ADAMW_BYTES_PER_PARAM / seconds


def measure_gpu_p2p_bytes_per_s(nbytes: int, *, repeats: int) -> float | None:
    """GPU 0 -> GPU 1 copy bandwidth [bytes/s]; 0.0 without peer access, None with fewer than 2 GPUs."""
    if torch.cuda.device_count() < 2:
        return None
    if not (torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)):
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(5)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    return nbytes / _time_s(copy, False, repeats=repeats, label="GPU-to-GPU copy")


def host_memory_bytes() -> int:
    """Physical host memory [bytes] (the CPU "device" memory)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# -- the profile ---------------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    """"auto": CUDA when available, else the CPU; "cuda" without CUDA is an error."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available (use --device cpu or auto)")
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def host_fields(sizes: Sizes, say: Progress, buffers: CopyBuffers | None, *, duplex_s: float | None = None) -> dict:
    """The host's DRAM rate and CPU AdamW fields of a profile (HOST_FIELDS but the cores and the compiled
    host floor); `buffers` (CUDA only) time the AdamW beside the copies, `duplex_s` the copies alone (None:
    timed here)."""
    reps = sizes.repeats
    host_dram = measure_host_dram_bytes_per_s(sizes.host_copy_bytes, repeats=reps)
    say(f"host DRAM       copy of {format_bytes(sizes.host_copy_bytes)} on {os.cpu_count()} threads: "
        f"{host_dram / 1e9:.4g} GB/s (read + write)")

    state = AdamwState(sizes.adamw_numel)
    state.step(1)  # compile (or load the cache) outside the timings
    by_threads = adamw_rates(state.numel, measure_adamw_s(
        state, thread_counts(min(os.cpu_count() or 1, get_num_threads())), repeats=reps))
    best_threads, best = max(by_threads, key=lambda point: point[1])
    say("CPU AdamW       " + ", ".join(f"{t} threads {r / 1e9:.3g}" for t, r in by_threads)
        + f" G params/s ({state.numel / 1e6:g} M params, bf16 grad in, bf16 weights out)")

    if buffers is not None:
        contended_s = measure_adamw_contended_s(state, best_threads, buffers, repeats=reps)
        contended = fraction_kept(state.numel / contended_s, best)
        say(f"AdamW + copies  {best_threads} threads while H2D and D2H run: {state.numel / contended_s / 1e9:.3g} "
            f"G params/s, fraction {contended:.3f}")
        state.step(best_threads, out_of_place=True)  # its spare arrays touched outside the timing
        early_s = measure_adamw_contended_s(state, best_threads, buffers, repeats=reps, out_of_place=True)
        backward = fraction_kept(state.numel / early_s, best)
        say(f"early update    {best_threads} threads, out of place, while H2D and D2H run: "
            f"{state.numel / early_s / 1e9:.3g} G params/s, fraction {backward:.3f}, cpu_adamw_backward_fraction")
        duplex_s = measure_duplex_s(buffers, repeats=reps) if duplex_s is None else duplex_s
        copies_contended = min(1.0, duplex_s / measure_duplex_contended_s(state, best_threads, buffers, repeats=reps))
        say(f"copies + AdamW  H2D and D2H at once while {best_threads} threads run the CPU AdamW: fraction "
            f"{copies_contended:.3f} of their rate alone, duplex_contended_fraction")
    else:
        contended = copies_contended = 1.0
        say("AdamW + copies  1.0 on the CPU device: no DMA engine, the copies and the update share the cores in order")
        backward = fraction_kept(state.numel / measure_adamw_out_of_place_s(state, best_threads, repeats=reps), best)
        say(f"early update    {best_threads} threads, out of place: fraction {backward:.3f} of the in-place "
            "rate, cpu_adamw_backward_fraction")
    return dict(host_dram_bytes_per_s=host_dram, cpu_adamw_params_per_s=best, cpu_adamw_params_per_s_by_threads=by_threads,
                cpu_adamw_contended_fraction=contended, cpu_adamw_backward_fraction=backward,
                duplex_contended_fraction=copies_contended)


def calibrate_host(base: Hardware, *, device: str = "auto", quick: bool = False,
                   progress: Progress | None = None) -> Hardware:
    """`base` (a profile of this GPU model, measured on another host or fitted) with the fields of this
    host measured again (HOST_FIELDS: its CPU AdamW, DRAM, cores and the engine's time to issue a compiled
    block), in under a minute; its name says so. The GPU's own figures stay base's; on the CPU device (no
    copies to time beside the AdamW, no compiled blocks) so do the shares under contention and the floor."""
    global _timings
    say = progress or (lambda line: None)
    previous, _timings = _timings, Timings(QUICK_MAX_RUN_S if quick else MAX_RUN_S, say)
    try:
        dev = resolve_device(device)
        cuda = dev.type == "cuda"
        sizes = default_sizes(cuda, quick)
        say(f"calibrating this host ({os.cpu_count()} CPU cores) for {base.name}")
        buffers = CopyBuffers(dev, sizes.transfer_bytes[-1]) if cuda else None
        host = host_fields(sizes, say, buffers)
        del buffers
        if not cuda:  # measured without copies: base's shares beside them stand
            for field in ("cpu_adamw_contended_fraction", "cpu_adamw_backward_fraction", "duplex_contended_fraction"):
                host[field] = getattr(base, field)
            say("shares beside copies and the compiled host floor: base's (not measured on the CPU device)")
        fwd, bwd = compiled_host_floor(dev, say) if cuda else (base.host_compiled_fwd_s, base.host_compiled_bwd_s)
    finally:
        _timings = previous
    return with_host(base, replace(base, cpu_cores=os.cpu_count() or 1, host_compiled_fwd_s=fwd,
                                   host_compiled_bwd_s=bwd, **host))


def calibrate(*, device: str = "auto", quick: bool = False, progress: Progress | None = None,
              model_shape: BlockShape | dict | None = None) -> Hardware:
    """Measure the running machine into a Hardware profile.

    device: "auto" (CUDA if present), "cuda" (GPU 0) or "cpu" (the CPU backend's host "device").
    quick: small sizes and fewer repeats (seconds instead of a minute or two; rougher figures).
    progress: called with one line per measurement, as it is made (e.g. `print`); None is silent.
    model_shape: the transformer block whose fwd+bwd gives block_efficiency (a BlockShape or its
    fields as a dict); default a Qwen3-4B block at 4096 tokens on CUDA, a tiny one on the CPU.
    """
    global _timings
    say = progress or (lambda line: None)
    previous, _timings = _timings, Timings(QUICK_MAX_RUN_S if quick else MAX_RUN_S, say)
    try:
        hw = _calibrate(device, quick, say, model_shape)
        unstable = _timings.unstable()
        worst = max(_timings.all, key=lambda t: t.spread, default=None)
        if worst is not None:
            say(f"spread          {len(_timings.all)} measurements, medians of adaptive repeats; largest IQR/median "
                f"{100 * worst.spread:.1f}% ({worst.label})"
                + (f"; {len(unstable)} above {SPREAD_WARN:.0%}: rougher figures" if unstable else ""))
        return hw
    finally:
        _timings = previous


def _calibrate(device: str, quick: bool, say: Progress, model_shape) -> Hardware:
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    sizes = default_sizes(cuda, quick)
    shape = sizes.block if model_shape is None else (
        model_shape if isinstance(model_shape, BlockShape) else BlockShape(**model_shape))
    reps = sizes.repeats
    if cuda:
        torch.cuda.set_device(dev)
        say(f"calibrating {torch.cuda.get_device_name(dev)} ({'quick' if quick else 'full'}); "
            f"{os.cpu_count()} CPU cores")
    else:
        say(f"calibrating the CPU device ({'quick' if quick else 'full'}); {os.cpu_count()} CPU cores, "
            f"torch uses {torch.get_num_threads()} threads")

    matmul = measure_matmul_flops_per_s(dev, sizes.matmul_n, repeats=reps)
    say(f"matmul          {sizes.matmul_n}^3 {'bf16' if cuda else 'fp32'}: {matmul / 1e12:.4g} TFLOP/s")

    flops_fwd, flops_bwd = count_block_flops_fwd_bwd(shape, torch.bfloat16 if cuda else torch.float32)
    attention = 0.0  # the CPU's attention is no faster than the rest of its block: one rate
    if cuda:  # on sequences 4x the block's: the rate long sequences reach, where attention matters
        long = BlockShape(**{**shape.__dict__, "seq_len": 4 * shape.seq_len})
        long_fwd, long_bwd = attention_flops_fwd_bwd(long)
        attention = (long_fwd + long_bwd) / measure_attention_s(dev, long, repeats=reps)[1]
        say(f"attention       causal SDPA forward + backward, {long.batch_size}x{long.seq_len} tokens: "
            f"{attention / 1e12:.4g} TFLOP/s, attention_flops_per_s")
        torch.cuda.empty_cache()

    def rest_efficiency(seconds: float, forwards: int) -> float:
        return rest_flops_per_s(shape, seconds, forwards, attention, cuda) / matmul

    flops = flops_fwd + flops_bwd
    block_s = measure_block_fwd_bwd_s(dev, shape, repeats=reps)
    efficiency = rest_efficiency(block_s, 1)
    say(f"block fwd+bwd   Qwen3 hidden {shape.hidden_size}, {shape.batch_size}x{shape.seq_len} tokens: "
        f"{block_s * 1e3:.4g} ms for {flops / 1e12:.4g} TFLOP = {flops / block_s / 1e12:.4g} TFLOP/s, "
        f"block_efficiency {efficiency:.3f}" + (" (of the FLOPs but attention's)" if attention else ""))
    compiled_efficiency = 0.0  # the CPU backend does not compile blocks by default (api.compile)
    host_compiled = (0.0, 0.0)
    if cuda:
        torch.cuda.empty_cache()
        recompute_flops = 2 * flops_fwd + flops_bwd
        compiled_s = measure_block_fwd_bwd_s(dev, shape, repeats=reps, compiled=True)
        compiled_efficiency = rest_efficiency(compiled_s, 2)
        say(f"compiled block  forward, recompute + backward (torch.compile): {compiled_s * 1e3:.4g} ms for "
            f"{recompute_flops / 1e12:.4g} TFLOP = {recompute_flops / compiled_s / 1e12:.4g} TFLOP/s, "
            f"compiled_block_efficiency {compiled_efficiency:.3f}")
        torch.cuda.empty_cache()
        host_compiled = compiled_host_floor(dev, say)
        torch.cuda.empty_cache()

    buffers = CopyBuffers(dev, sizes.transfer_bytes[-1])
    h2d, curve = transfer_profile(measure_h2d_by_size(buffers, sizes.transfer_bytes, repeats=reps))
    say("H2D by size     " + ", ".join(f"{format_bytes(b)} {f * h2d / 1e9:.3g}" for b, f in curve)
        + f" GB/s; large-copy rate {h2d / 1e9:.4g} GB/s" + ("" if cuda else " (host memcpy)"))
    big = buffers.nbytes
    d2h = large_copy_rate(big, measure_d2h_s(buffers, repeats=reps), curve)
    say(f"D2H             {format_bytes(big)}: {d2h / 1e9:.4g} GB/s")
    duplex_s = measure_duplex_s(buffers, repeats=reps)
    duplex = 2 * large_copy_rate(big, duplex_s, curve)  # two copies of `big` in duplex_s
    say(f"H2D + D2H       {format_bytes(big)} each {'at once' if cuda else 'in order (CPU backend)'}: "
        f"{duplex / 1e9:.4g} GB/s total")

    host = host_fields(sizes, say, buffers if cuda else None, duplex_s=duplex_s)
    del buffers

    device_adamw = 0.0  # the CPU device keeps the optimizer state on the host (scheduler: never on the "device")
    if cuda:
        device_adamw = measure_device_adamw_bytes_per_s(dev, sizes.adamw_numel, repeats=reps)
        say(f"device AdamW    {sizes.adamw_numel / 1e6:g} M params (bf16 grad, fp32 state): "
            f"{device_adamw / 1e9:.4g} GB/s of device memory, gpu_memory_bytes_per_s")
        torch.cuda.empty_cache()

    p2p = None
    if cuda:
        torch.cuda.empty_cache()
        p2p = measure_gpu_p2p_bytes_per_s(sizes.p2p_bytes, repeats=reps)
    if p2p is None:
        say("GPU-to-GPU      one device visible: 0.0")
    elif p2p == 0.0:
        say("GPU-to-GPU      no peer access between GPU 0 and 1: 0.0")
    else:
        say(f"GPU-to-GPU      GPU 0 -> 1, {format_bytes(sizes.p2p_bytes)}: {p2p / 1e9:.4g} GB/s")
    say("root complex    gpus_per_root_complex left at 1: the PCIe topology is not measured")

    if cuda:
        props = torch.cuda.get_device_properties(dev)
        name, memory = f"calibrated:{props.name}", int(props.total_memory)
    else:
        name, memory = "calibrated:cpu", host_memory_bytes()
    say(f"memory          {format_bytes(memory)} on the {'GPU' if cuda else 'host'}")
    return Hardware(
        name=name, gpu_memory_bytes=memory, matmul_flops_per_s=matmul, block_efficiency=efficiency,
        h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, duplex_bytes_per_s=duplex, cpu_cores=os.cpu_count() or 1,
        gpu_p2p_bytes_per_s=p2p or 0.0, transfer_efficiency=curve, compiled_block_efficiency=compiled_efficiency,
        host_compiled_fwd_s=host_compiled[0], host_compiled_bwd_s=host_compiled[1],
        gpu_memory_bytes_per_s=device_adamw, attention_flops_per_s=attention, **host,
    )
