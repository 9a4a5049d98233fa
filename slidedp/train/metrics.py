"""Live metrics of `slidedp train`: a JSONL file, a per-step line, a progress bar, TensorBoard.

- ``metrics.jsonl``: one JSON record per step (and the validation loss in the record of the steps
  where it was measured); a resumed run first drops the records of steps after its checkpoint.
- the per-step line (every ``log_every`` steps, stderr): loss, gradient norm, learning rate,
  tokens/s, TFLOP/s and MFU (where the device's peak is known), device and host memory,
  measured vs predicted step time (the prediction only where the hardware profile is a
  measurement or the preset of this GPU: a preset's guess for this machine, the "cpu" preset or
  an unknown GPU, is recorded as ``preset_estimate_step_s`` and left off the line).
- a progress bar: tqdm when installed (the per-step lines are printed above it), else the
  per-step lines alone, which carry the step count and the remaining time.
- TensorBoard scalars under ``<output_dir>/tensorboard`` when the ``tensorboard`` package is
  installed (never required; without it, a warning once says so).
- the same scalars to Weights & Biases (offline) and MLflow (local file store) when ``report_to``
  names them (train/trackers.py).

FLOPs per step come from the layer graph (``LayerCosts`` per micro-batch: forward + backward,
without recomputation, the usual model-FLOPs convention); the peak is the plan's hardware
``matmul_flops_per_s``, used for MFU on a GPU only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from slidedp.logs import warn_once


def model_flops_per_step(graph, micro_batches: int) -> float:
    """Forward + backward FLOPs of one step: the graph's per-micro-batch costs times micro-batches."""
    return micro_batches * sum(layer.costs.flops_fwd + layer.costs.flops_bwd for layer in graph.layers)


def peak_flops_per_s(plan, device: torch.device) -> float | None:
    """The accelerator's peak matmul rate from the plan's hardware; None on the CPU (not known)."""
    if device.type != "cuda":
        return None
    rate = float(plan.hardware.get("matmul_flops_per_s") or 0.0)
    return rate or None


def host_rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # POSIX only, and only for this fallback

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_memory_bytes(device: torch.device) -> int | None:
    """Peak device memory allocated since the last call (CUDA); None on the CPU."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(peak)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_line(r: dict, max_steps: int, eta_s: float | None) -> str:
    parts = [f"step {r['step']:>5}/{max_steps}", f"loss {r['loss']:.4f}"]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    parts += [f"grad norm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:.0f} tok/s",
              f"{r['tflops']:.3g} TFLOP/s"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts += [f"dev {_gib(r.get('device_bytes'))}", f"host {_gib(r.get('host_rss_bytes'))}",
              f"step {r['step_s']:.2f}s" + (f" (predicted {r['predicted_step_s']:.2f}s)"
                                             if r.get("predicted_step_s") is not None else "")]
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite gradient)")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return "  ".join(parts)


def _tensorboard_writer(log_dir: Path):
    """A SummaryWriter if the `tensorboard` package is installed, else None."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter  # optional package, checked above

    return SummaryWriter(log_dir=str(log_dir))


def _tqdm(**kwargs):
    if importlib.util.find_spec("tqdm") is None:
        return None
    from tqdm import tqdm  # optional package, checked above

    return tqdm(**kwargs)


class MetricsLogger:
    """Writes each step's record to the JSONL file, TensorBoard, the progress bar and stderr."""

    SCALARS = ("loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "step_s")

    def __init__(self, out_dir: Path, *, max_steps: int, start_step: int, log_every: int, progress: bool,
                 tensorboard: bool, trackers: list = ()):
        self.trackers = list(trackers)  # train/trackers.py: wandb, mlflow (offline)
        self.max_steps = max_steps
        self.start_step = start_step
        self.log_every = log_every
        path = out_dir / "metrics.jsonl"
        kept = []
        if start_step > 0 and path.is_file():  # resumed: keep the records up to the checkpoint's step
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= start_step:
                        kept.append(line)
                except ValueError:
                    pass
        self.file = open(path, "w")
        for line in kept:
            self.file.write(line + "\n")
        self.file.flush()
        self.tb = _tensorboard_writer(out_dir / "tensorboard") if tensorboard else None
        if tensorboard and self.tb is None:
            warn_once(("tensorboard",), "TensorBoard is not installed: no scalars under %s (metrics.jsonl has "
                      "every record); `pip install tensorboard` to get them, or tensorboard=false to silence this",
                      out_dir / "tensorboard")
        self.bar = None
        if progress:  # disable=None: no bar when stderr is not a terminal (logs get the lines only)
            self.bar = _tqdm(total=max_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True, leave=True, disable=None)
            if self.bar is not None and self.bar.disable:
                self.bar = None
        self.t0 = time.perf_counter()

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for key in self.SCALARS:
                if record.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", record[key], step)
        scalars = {key: record[key] for key in self.SCALARS if record.get(key) is not None}
        for tracker in self.trackers:
            tracker.log(scalars, step)
        done = step - self.start_step
        eta = (time.perf_counter() - self.t0) / done * (self.max_steps - step) if done > 0 else None
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if step % self.log_every == 0 or step == self.max_steps:
            self.write(format_line(record, self.max_steps, None if self.bar is not None else eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        self.file.close()
