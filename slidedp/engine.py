"""The Engine: one synchronous optimizer step on a global batch, over a streamed executor."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from slidedp.backend import cpu_adamw
from slidedp.backend.executor import MicroBatch, StreamedExecutor
from slidedp.backend.host_state import HostState
from slidedp.backend.update_stream import UpdateStream
from slidedp.ir.graph import LayerGraph
from slidedp.optim import AdamW
from slidedp.scheduler.plan import Plan

log = logging.getLogger("slidedp")


@dataclass(frozen=True)
class StepInfo:
    step: int  # optimizer steps taken so far
    loss: float
    grad_norm: float
    clip_coef: float
    skipped: bool  # non-finite gradient: nothing was updated
    tokens: int  # tokens that carried a label in this step
    wait_s: float = 0.0  # waiting for the previous step's CPU update before this step's pass could finish it
    pass_s: float = 0.0  # from the call to the whole gradient's norm on the host (forward + backward)


class Engine:
    """Created by `slidedp.compile`; owns the host state, device buffers and optimizer."""

    def __init__(self, *, model: nn.Module, graph: LayerGraph, plan: Plan, host: HostState,
                 executor: StreamedExecutor, optimizer: AdamW, max_grad_norm: float | None,
                 device: torch.device, precision: str):
        self.model = model
        self.graph = graph
        self.plan = plan
        self.host = host
        self.executor = executor
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.device = device
        self.precision = precision
        self.skipped_steps = 0
        self.last_step: StepInfo | None = None
        self._staging: list[torch.Tensor] | None = None
        self._decay_segments = [_decay_segments(layer, optimizer) for layer in graph.layers]
        self._closed = False
        # The CPU update of step t runs on its own thread while step t+1 starts; each layer's
        # update sets its event, and the executor waits for it before it reads the layer's
        # weights (H2D) or writes its gradient (D2H). See `UpdateStream`.
        self.updates = UpdateStream(order=update_order(plan, graph), num_threads=_update_threads(device))
        executor.wait_for_update = self.updates.wait

    # -- the step -------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None) -> float:
        """One optimizer step on the global batch; returns the token-weighted mean loss."""
        self._check_open()
        input_ids, labels, attention_mask = self._validate(input_ids, labels, attention_mask)
        tokens = int((labels[:, 1:] != -100).sum())
        if tokens == 0:
            raise ValueError("every label in the batch is -100 (or sequences are 1 token): nothing to train on")
        w = self.plan.workload
        rows_per_mb = w.batch_size
        mbs = [
            MicroBatch(
                input_ids[r : r + rows_per_mb].to(self.device, non_blocking=True),
                labels[r : r + rows_per_mb].to(self.device, non_blocking=True),
                None if attention_mask is None else attention_mask[r : r + rows_per_mb].to(self.device),
            )
            for r in range(0, input_ids.shape[0], rows_per_mb)
        ]
        passes = [mbs[i : i + w.micro_batches] for i in range(0, len(mbs), w.micro_batches)]

        t_start = time.perf_counter()
        grads = [layer.grad for layer in self.host.layers]
        loss = torch.zeros((), dtype=torch.float64)
        sumsq_device = None
        for k, group in enumerate(passes):
            targets = grads if k == 0 else self._staging_buffers()
            result = self.executor.run_pass(group, tokens, targets)
            loss += result.loss_sum.double().cpu()
            if k > 0:  # accumulate on the host, in the host gradient's dtype (fp32 sums inside)
                for layer_grad, staged, guard in zip(grads, targets, result.d2h):
                    guard.host_wait()
                    layer_grad.add_(staged)
            sumsq_device = result.sumsq if len(passes) == 1 else None
            d2h = result.d2h
        if sumsq_device is not None:
            sumsq = torch.stack([s.float() for s in sumsq_device]).double().cpu()
        else:
            sumsq = torch.stack([torch.linalg.vector_norm(g.float()).double() ** 2 for g in grads])
        norm = float(sumsq.sum().sqrt())
        loss_value = float(loss)
        timing = dict(wait_s=self.updates.last_wait_s, pass_s=time.perf_counter() - t_start)
        if not math.isfinite(norm):
            self.skipped_steps += 1
            log.warning("step skipped: non-finite gradient (norm %s); %d skipped so far", norm, self.skipped_steps)
            self.last_step = StepInfo(self.host.step, loss_value, norm, 0.0, True, tokens, **timing)
            return loss_value
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
        self._update(d2h, clip)
        self.last_step = StepInfo(self.host.step, loss_value, norm, clip, False, tokens, **timing)
        return loss_value

    def _update(self, d2h, clip: float) -> None:
        """Start AdamW on every layer (fp32 master, bf16 delivery copy written), in update order,
        on the update thread; returns at once. Each layer first waits for its gradient's D2H."""
        self.host.step += 1
        step, opt, host = self.host.step, self.optimizer, self.host

        def update(layer_id: int, num_threads: int) -> None:
            d2h[layer_id].host_wait()
            layer = host.layers[layer_id]
            arrays = [host.numpy(t) if t is not None else None
                      for t in (layer.master, layer.grad, layer.exp_avg, layer.exp_avg_sq, layer.delivery)]
            for start, end, decay in self._decay_segments[layer_id]:
                p, g, m, v, out = (a[start:end] if a is not None else None for a in arrays)
                cpu_adamw.adamw_step(
                    p, g, m, v, out, lr=opt.lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                    weight_decay=opt.weight_decay if decay else 0.0, step=step, grad_scale=clip,
                    num_threads=num_threads,
                )

        self.updates.start(update)
        self.executor.resident_stale.update(self.executor.resident_ids)

    def _staging_buffers(self) -> list[torch.Tensor]:
        if self._staging is None:
            self._staging = [torch.empty_like(layer.grad) for layer in self.host.layers]
            if self.device.type == "cuda":
                self._staging = [t.pin_memory() for t in self._staging]
        return self._staging

    # -- inputs ---------------------------------------------------------------------------------
    def _validate(self, input_ids, labels, attention_mask):
        w = self.plan.workload
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() != 2:
            raise TypeError(f"input_ids must be a 2-D integer tensor [rows, seq_len], got {input_ids.dtype} "
                            f"of shape {tuple(input_ids.shape)}")
        rows, seq = input_ids.shape
        if seq != w.seq_len:
            raise ValueError(f"input_ids has sequence length {seq}, but the engine was compiled for seq_len={w.seq_len}")
        unit = w.batch_size * w.world_size
        if rows == 0 or rows % unit:
            raise ValueError(f"input_ids has {rows} rows; it must be a positive multiple of "
                             f"batch_size x world_size = {w.batch_size} x {w.world_size} = {unit}")
        vocab = self.graph.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids has token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab})")
        input_ids = input_ids.long()
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must be a tensor of shape {tuple(input_ids.shape)}")
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("attention_mask must contain only 0 and 1")
            attention_mask = attention_mask.long()
        if labels is None:
            labels = input_ids.clone()
            if attention_mask is not None:
                labels[attention_mask == 0] = -100
        else:
            if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
                raise ValueError(f"labels must be a tensor of the same shape as input_ids {tuple(input_ids.shape)}, "
                                 f"got {getattr(labels, 'shape', type(labels).__name__)}")
            labels = labels.long()
            bad = (labels != -100) & ((labels < 0) | (labels >= vocab))
            if bool(bad.any()):
                raise ValueError(f"labels must be -100 or token ids in [0, {vocab}); found {int(labels[bad][0])}")
        return input_ids, labels, attention_mask

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 CPU tensor}: the master weights, under every name the model uses."""
        self._check_open()
        self.updates.flush()
        out = {}
        for layer in self.graph.layers:
            views = self.host.layers[layer.id].param_views(self.host.layers[layer.id].master)
            for p in layer.params:
                value = views[p.name].clone()
                for name in (p.name, *p.aliases):
                    out[name] = value
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if not p.requires_grad and name not in out:
                out[name] = p.detach().float().cpu().clone()
        return out

    def close(self) -> None:
        """Free device buffers and the host state; the model keeps copies of the trained weights."""
        if self._closed:
            return
        self._closed = True
        try:
            self.updates.flush()
        finally:
            self.updates.close()
        for p in self.model.parameters():
            if p.requires_grad and p.device.type == "cpu":
                p.data = p.data.clone()
        self.executor = None
        self.host.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this slidedp engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- evaluation, checkpoints, export (slidedp/checkpoint.py) -----------------------------------
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> float:
        """Token-weighted mean loss of the current weights on the rows given; nothing is updated.

        Runs the same streamed passes as `step` (the same numerics, on the same device), and
        discards the gradients. Any number of rows: the last micro-batch is filled up with rows
        that carry no label.
        """
        self._check_open()
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 0:
            unit = self.plan.workload.batch_size * self.plan.workload.world_size
            pad = -input_ids.shape[0] % unit
            if pad:
                if labels is None:
                    labels = input_ids.clone()
                    if attention_mask is not None:
                        labels[attention_mask == 0] = -100
                input_ids = torch.cat([input_ids, input_ids[:1].expand(pad, -1)])
                labels = torch.cat([labels, labels.new_full((pad, labels.shape[1]), -100)])
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, attention_mask.new_ones(pad, attention_mask.shape[1])])
        input_ids, labels, attention_mask = self._validate(input_ids, labels, attention_mask)
        tokens = int((labels[:, 1:] != -100).sum())
        if tokens == 0:
            raise ValueError("every label in the batch is -100 (or sequences are 1 token): nothing to evaluate")
        self.updates.flush()  # the pending update has read the host gradients, which the passes overwrite
        w = self.plan.workload
        mbs = [
            MicroBatch(
                input_ids[r : r + w.batch_size].to(self.device),
                labels[r : r + w.batch_size].to(self.device),
                None if attention_mask is None else attention_mask[r : r + w.batch_size].to(self.device),
            )
            for r in range(0, input_ids.shape[0], w.batch_size)
        ]
        grads = [layer.grad for layer in self.host.layers]
        loss = torch.zeros((), dtype=torch.float64)
        for i in range(0, len(mbs), w.micro_batches):
            result = self.executor.run_pass(mbs[i : i + w.micro_batches], tokens, grads)
            loss += result.loss_sum.double().cpu()
            for guard in result.d2h:
                if guard is not None:
                    guard.host_wait()
        return float(loss)

    def save_checkpoint(self, dir) -> None:
        """Master weights, AdamW moments and step, RNG, plan and model config into the folder `dir`,
        atomically (safetensors and JSON, with a sha256 manifest; see slidedp/checkpoint.py)."""
        from slidedp.checkpoint import atomic_checkpoint, write_engine_state

        self._check_open()
        with atomic_checkpoint(dir) as writer:
            write_engine_state(self, writer)

    def load_checkpoint(self, dir) -> None:
        """Restore a checkpoint of `save_checkpoint` (every file is verified first); the model must
        have the same parameters. The optimizer settings stay those given to `compile`."""
        from slidedp.checkpoint import read_engine_state

        self._check_open()
        read_engine_state(self, dir)

    def export_hf(self, dir) -> None:
        """A `save_pretrained` folder of the model with the fp32 master weights (Hugging Face models)."""
        from slidedp.checkpoint import save_hf

        self._check_open()
        self.updates.flush()
        weights: dict[str, torch.Tensor] = {}
        for layer in self.graph.layers:
            views = self.host.layers[layer.id].param_views(self.host.layers[layer.id].master)
            for p in layer.params:
                for name in (p.name, *p.aliases):
                    weights[name] = views[p.name]
        for name, p in self.model.named_parameters(remove_duplicate=False):
            weights.setdefault(name, p.detach().float().cpu())
        save_hf(self.model, weights, dir)


def update_order(plan: Plan, graph: LayerGraph) -> list[int]:
    """The plan's update order (every layer once), or prologue, blocks, epilogue for a plan without one."""
    default = [graph.prologue.id] + [b.id for b in graph.blocks] + [graph.epilogue.id]
    order = list(plan.update_order) or default
    if sorted(order) != sorted(default):
        raise ValueError(f"the plan's update_order {order} is not a permutation of the layer ids {default}")
    return order


def _update_threads(device: torch.device) -> int | None:
    """CPU threads for the optimizer: all but one core when a GPU needs a thread to issue work."""
    if device.type != "cuda":
        return None
    return max(1, (os.cpu_count() or 2) - 1)


def _decay_segments(layer, optimizer: AdamW) -> list[tuple[int, int, bool]]:
    """Runs of consecutive parameters sharing a weight-decay setting: (start, end, decay)."""
    segments: list[tuple[int, int, bool]] = []
    start = 0
    for p in layer.params:
        decay = not (optimizer.no_decay_groups and p.no_decay)
        end = start + p.numel
        if segments and segments[-1][2] == decay and segments[-1][1] == start:
            segments[-1] = (segments[-1][0], end, decay)
        else:
            segments.append((start, end, decay))
        start = end
    return segments
