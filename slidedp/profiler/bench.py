"""`slidedp bench`: slidedp's throughput against plain PyTorch in the same process, and predicted
against measured step time.

For each tokens-per-step value, on the same random-init model and the same batches:

- slidedp: `compile` with one pass over the weights per step (micro_batches = rows / batch_size);
- the baseline: the model resident on the device, `torch.optim.AdamW` (fused on CUDA, with bf16
  autocast and activation checkpointing when the model supports it), the same rows in micro-batches
  of `batch_size` with gradient accumulation, clipping as slidedp.

Both take one warm-up step and then `steps` timed steps; tokens/s counts every token of a step.
A baseline that runs out of memory is reported as such. The full benchmark of record, with
FSDP2 as well, is `benchmarks/h200_qwen3_4b.py`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from slidedp import api


@dataclass(frozen=True)
class BenchRecord:
    system: str  # "slidedp" | "pytorch"
    tokens_per_step: int
    tokens_per_s: float | None  # None: out of memory
    measured_step_s: float | None
    predicted_step_s: float | None
    peak_device_bytes: int | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_slidedp(model, batches, *, budget, batch_size: int, seq_len: int, device: torch.device, precision: str,
                  hardware, lr: float, max_grad_norm: float) -> BenchRecord:
    rows = batches[0].shape[0]
    _reset_peak(device)
    engine = api.compile(model, budget, batch_size=batch_size, seq_len=seq_len, device=device.type,
                             precision=precision, hardware=hardware, micro_batches=rows // batch_size,
                             optimizer=api.AdamW(lr=lr), max_grad_norm=max_grad_norm)
    with engine:
        engine.step(batches[0])
        engine.updates.flush()
        t0 = time.perf_counter()
        for ids in batches[1:]:
            engine.step(ids)
        engine.updates.flush()  # the last step's update belongs to the measured time
        step_s = (time.perf_counter() - t0) / (len(batches) - 1)
        return BenchRecord("slidedp", rows * seq_len, rows * seq_len / step_s, step_s,
                           engine.plan.predicted_step_time_s, _peak(device))


def bench_pytorch(model, batches, *, batch_size: int, seq_len: int, device: torch.device, precision: str,
                  lr: float, max_grad_norm: float) -> BenchRecord:
    rows = batches[0].shape[0]
    _reset_peak(device)
    try:
        model = model.to(device)
        if hasattr(model, "gradient_checkpointing_enable") and device.type == "cuda":
            model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

        def step(ids: torch.Tensor) -> None:
            ids = ids.to(device)
            tokens = (ids.shape[1] - 1) * ids.shape[0]
            for r in range(0, rows, batch_size):
                part = ids[r : r + batch_size]
                with autocast:
                    out = model(part)
                logits = (out.logits if hasattr(out, "logits") else out).float()
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1),
                                       reduction="sum") / tokens
                loss.backward()
                del logits, out, loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(batches[0])
        _sync(device)
        t0 = time.perf_counter()
        for ids in batches[1:]:
            step(ids)
        _sync(device)
        step_s = (time.perf_counter() - t0) / (len(batches) - 1)
        return BenchRecord("pytorch", rows * seq_len, rows * seq_len / step_s, step_s, None, _peak(device))
    except torch.OutOfMemoryError:
        return BenchRecord("pytorch", rows * seq_len, None, None, None, _peak(device))
    finally:
        model.to("cpu")
        _reset_peak(device)


def run_bench(model, *, budget, tokens: list[int], batch_size: int, seq_len: int, device: torch.device,
              precision: str, hardware=None, steps: int = 3, lr: float = 1e-5, max_grad_norm: float = 1.0,
              seed: int = 0, progress=print) -> list[BenchRecord]:
    """slidedp and the resident PyTorch baseline at each tokens-per-step value (a multiple of
    batch_size x seq_len); `model` is left untouched (each system trains its own copy)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    records = []
    for n in tokens:
        if n <= 0 or n % (batch_size * seq_len):
            raise ValueError(f"tokens per step {n} is not a positive multiple of batch_size x seq_len = "
                             f"{batch_size} x {seq_len}")
        rows = n // seq_len
        gen = torch.Generator().manual_seed(seed)
        vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else None
        if vocab is None:
            raise ValueError("slidedp bench needs a causal LM with output embeddings")
        batches = [torch.randint(0, vocab, (rows, seq_len), generator=gen) for _ in range(steps + 1)]
        kwargs = dict(batch_size=batch_size, seq_len=seq_len, device=device, precision=precision, lr=lr,
                      max_grad_norm=max_grad_norm)
        for system in ("slidedp", "pytorch"):
            copy_ = copy.deepcopy(model)
            if system == "slidedp":
                record = bench_slidedp(copy_, batches, budget=budget, hardware=hardware, **kwargs)
            else:
                record = bench_pytorch(copy_, batches, **kwargs)
            del copy_
            records.append(record)
            progress(format_record(record))
    return records


def format_record(r: BenchRecord) -> str:
    if r.tokens_per_s is None:
        return f"{r.tokens_per_step:>9,} tokens/step  {r.system:<8} out of memory"
    predicted = f", predicted {r.predicted_step_s:.3f} s" if r.predicted_step_s is not None else ""
    peak = f", peak device {r.peak_device_bytes / 2**30:.1f} GiB" if r.peak_device_bytes is not None else ""
    return (f"{r.tokens_per_step:>9,} tokens/step  {r.system:<8} {r.tokens_per_s:>10,.0f} tokens/s  "
            f"step {r.measured_step_s:.3f} s{predicted}{peak}")


def ratios(records: list[BenchRecord]) -> list[dict]:
    """Per tokens-per-step value: slidedp's tokens/s over the baseline's, and measured over predicted."""
    out = []
    for n in sorted({r.tokens_per_step for r in records}):
        s = next(r for r in records if r.tokens_per_step == n and r.system == "slidedp")
        b = next(r for r in records if r.tokens_per_step == n and r.system == "pytorch")
        out.append({"tokens_per_step": n,
                    "slidedp_over_pytorch": s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else None,
                    "measured_over_predicted": s.measured_step_s / s.predicted_step_s})
    return out


def to_json(records: list[BenchRecord]) -> dict:
    return {"records": [asdict(r) for r in records], "ratios": ratios(records)}
