"""The Engine: one synchronous optimizer step on a global batch, over one rank or several."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from slidedp.backend.state.host_state import HostState
from slidedp.backend.state.staging import to_host
from slidedp.backend.runtime.rank import Rank
from slidedp.backend.runtime.workers import WorkerPool
from slidedp.ir.graph import LayerGraph
from slidedp.optim import AdamW
from slidedp.errors import NonFiniteGradientError
from slidedp.backend.state.host_state import host_runs
from slidedp.budget import format_bytes
from slidedp.run.device_memory import DeviceMemoryWatch, local_peaks
from slidedp.run.preflight import host_available_bytes
from slidedp.run.checkpoint import (
    CheckpointError, apply_engine_meta, atomic_checkpoint, check_engine_checkpoint,
    read_engine_state, read_state_arrays, save_hf, write_engine_state, write_sharded_checkpoint,
)
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
    # of pass_s, the host's time issuing the blocks' forwards and backwards (the busiest rank's), wall
    # time: it holds the waits of a full launch queue too, so it tells a host-bound pass (close to
    # pass_s less wait_s) only beside the device's busy time (diagnose_step's profile)
    block_issue_s: float = 0.0
    # wall time of the CPU's round of updates after the previous step's boundary, which this step's loads
    # waited on (one process, no early updates); None: not timed (the first step, early or streamed
    # updates, ranks in worker processes)
    update_s: float | None = None


class Engine:
    """Created by `slidedp.compile`; owns the host state and the ranks that train on it.

    `runner` is the local rank (`backend.runtime.rank.Rank`, one process) or the pool of worker processes
    (`backend.runtime.workers.WorkerPool`, one per rank); both take a step on the global batch.
    """

    def __init__(self, *, model: nn.Module, graph: LayerGraph, plan: Plan, host: HostState,
                 runner: "Rank | WorkerPool", optimizer: AdamW, max_grad_norm: float | None,
                 device: torch.device, precision: str, nonfinite: str = "skip"):
        self.model = model
        self.graph = graph
        self.plan = plan
        self.host = host
        self.runner = runner
        self.executor = runner.executor if isinstance(runner, Rank) else None  # the local rank's
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite  # a non-finite gradient: "skip" the step, or "stop" (raise)
        self.device = device
        self.precision = precision
        self.skipped_steps = 0
        self.last_step: StepInfo | None = None
        self._memory = None if device.type != "cuda" else DeviceMemoryWatch(
            local_peaks(device) if isinstance(runner, Rank) else runner.device_memory, budget_bytes=plan.budget_bytes,
            predicted_peak_bytes=plan.explanation.peak_device_bytes, every_step=isinstance(runner, Rank))
        self._closed = False

    @property
    def updates(self):
        """The CPU updates of every rank: `.flush()` waits for them, `.last_duration_s` timed the last round."""
        return self.runner

    # -- the step -------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None) -> float:
        """One optimizer step on the global batch; returns the token-weighted mean loss."""
        self._check_open()
        result, tokens = self._run(input_ids, labels, attention_mask, self.optimizer)
        if result.skipped and self.nonfinite == "stop":
            raise NonFiniteGradientError(f"step {self.host.step + 1}: the gradient is not finite (norm "
                                         f"{result.grad_norm}); nothing was applied (nonfinite='stop')")
        if result.skipped:
            self.skipped_steps += 1
            log.warning("step skipped: non-finite gradient (norm %s); %d skipped so far",
                        result.grad_norm, self.skipped_steps)
        self.last_step = StepInfo(self.host.step, result.loss, result.grad_norm, result.clip_coef, result.skipped,
                                  tokens, wait_s=result.wait_s, pass_s=result.pass_s,
                                  block_issue_s=result.block_issue_s, update_s=self._round_s())
        if self._memory is not None:
            self._memory.after_step(self.host.step)
        return result.loss

    def _round_s(self) -> float | None:
        """StepInfo.update_s: the last finished round of updates after a step boundary, where timed."""
        timed = isinstance(self.runner, Rank) and not self.plan.early_order and not self.plan.streamed_gradients
        return self.runner.last_duration_s or None if timed else None

    def _run(self, input_ids, labels, attention_mask, optimizer: AdamW | None):
        input_ids, labels, attention_mask = self._validate(input_ids, labels, attention_mask)
        tokens = int((labels[:, 1:] != -100).sum())
        if tokens == 0:
            raise ValueError("every label in the batch is -100 (or sequences are 1 token): nothing to "
                             + ("train on" if optimizer is not None else "evaluate"))
        w = self.plan.workload
        result = self.runner.step(input_ids, labels, attention_mask, tokens, batch_size=w.batch_size,
                                  micro_batches=w.micro_batches, optimizer=optimizer,
                                  max_grad_norm=self.max_grad_norm)
        return result, tokens

    def reload(self) -> None:
        """The host state was rewritten (a checkpoint loaded): ranks reload their device copies."""
        self.runner.reload(self.host.step)

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
            if labels.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"labels must be an integer tensor (token ids, -100 where ignored), got {labels.dtype}")
            labels = labels.long()
            bad = (labels != -100) & ((labels < 0) | (labels >= vocab))
            if bool(bad.any()):
                raise ValueError(f"labels must be -100 or token ids in [0, {vocab}); found {int(labels[bad][0])}")
        return input_ids, labels, attention_mask

    # -- state ----------------------------------------------------------------------------------
    def master_views(self, layer_id: int) -> dict[str, torch.Tensor]:
        """{parameter name: view of its fp32 master weights}: in the host state, or on the device for a
        layer whose state lives there alone (lean, backend/state/host_state.py); of a layer held in
        part on this host (several hosts), views of a new tensor gathered from every host (a
        collective of every rank). After `sync_host`."""
        arrays = self.host.layers[layer_id]
        if arrays.layout.lean:
            return self.runner.device_state.param_views(layer_id)
        if not arrays.whole:
            return arrays.param_views(self.runner.gather_layer(layer_id))
        return arrays.param_views(arrays.master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 CPU tensor}: the master weights, under every name the model uses.
        With several hosts a collective of every rank: each layer is gathered from the hosts that
        hold it, one layer at a time, and every rank gets the whole dict."""
        self._check_open()
        self.runner.sync_host()
        out = {}
        for layer in self.graph.layers:
            views = self.master_views(layer.id)
            for p in layer.params:
                value = to_host(views[p.name])  # a device view a piece at a time
                for name in (p.name, *p.aliases):
                    out[name] = value
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if not p.requires_grad and name not in out:
                out[name] = p.detach().float().cpu().clone()
        return out

    def close(self, keep_weights: bool | None = None) -> None:
        """Free device buffers, worker processes and the host state. `keep_weights`: the model keeps
        copies of the trained weights (True), or its trained parameters go to the meta device (False).
        None (default): keep them where the copies fit in the host RAM available (MemAvailable), else
        log a warning and move them to the meta device: a model near the host's capacity would
        otherwise be killed for memory at the end of training (write a checkpoint or take
        `state_dict()` first to keep them)."""
        if self._closed:
            return
        self._closed = True
        if keep_weights is None:
            keep_weights = self._weights_fit_host()
        try:
            if keep_weights:
                self._unbind_device_params()
            else:
                self._drop_trained_params()
            self.runner.close()
        finally:
            for p in self.model.parameters():
                if p.requires_grad and p.device.type == "cpu":
                    p.data = p.data.clone()
            self.executor = None
            self.host.close()
            if self.device.type == "cuda" and torch.cuda.is_initialized():
                torch.cuda.synchronize(self.device)
                # cuBLAS keeps a workspace per stream that ran a matmul (32 MiB each on Hopper), in the
                # caching allocator: the engine's streams' would stay allocated after close()
                clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear_workspaces is not None:
                    clear_workspaces()
                torch.cuda.empty_cache()
                _empty_host_cache()

    def _weights_fit_host(self) -> bool:
        """Whether copies of every trained parameter (in its dtype) fit in the host RAM available now."""
        need_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        available_bytes = host_available_bytes()
        if available_bytes is None or need_bytes <= available_bytes:
            return True
        log.warning("slidedp: closing without copies of the trained weights (%s needed, %s of host RAM "
                    "available): the model's trained parameters are on the meta device; write a checkpoint "
                    "or take state_dict() before close() to keep them", format_bytes(need_bytes),
                    format_bytes(available_bytes))
        return False

    def _unbind_device_params(self) -> None:
        """The model's parameters of the lean layers (views of the device's master) become CPU tensors
        of their values, in the dtype they had when compiled, so the device's memory can go."""
        device_state = getattr(self.runner, "device_state", None)
        if device_state is None or not device_state.lean:
            return
        dtypes = getattr(device_state, "param_dtypes", {})
        for layer_id in sorted(device_state.lean):
            for name, view in device_state.param_views(layer_id).items():
                self.model.get_parameter(name).data = to_host(view, dtypes.get(name, view.dtype))

    def _drop_trained_params(self) -> None:
        """Each trained parameter of the model becomes a new meta-device parameter of its shape and
        dtype (tied ones stay tied); the old Parameter objects are emptied, so that none still views
        the host or device state about to be freed."""
        new: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.requires_grad or p.device.type == "meta":  # meta: held by another host
                    continue
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                    p.data = torch.empty(0, dtype=p.dtype)
                module._parameters[name] = new[id(p)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this slidedp engine is closed")

    def _check_whole_step(self, what: str) -> None:
        """Refuse to write out a state that is a step part-applied (updates written in place before a
        non-finite gradient or a failure: rank.py's `broken`; a worker rank's failure), which no run
        could resume from."""
        broken = getattr(self.runner, "broken", None)
        if broken is not None:
            raise RuntimeError(f"not {what}: {broken[1]}; load a checkpoint first")
        failed = getattr(self.runner, "failed", None)  # worker processes (WorkerPool)
        if failed is not None:
            raise RuntimeError(f"not {what}: {failed}; compile a new engine from the latest checkpoint")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- evaluation, checkpoints, export (slidedp/run/checkpoint.py) -----------------------------------
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
        result, _ = self._run(input_ids, labels, attention_mask, optimizer=None)
        return result.loss

    def save_checkpoint(self, dir, *, add=None) -> None:
        """Master weights, AdamW moments and step, RNG, plan and model config into the folder `dir`,
        atomically (safetensors and JSON, with a sha256 manifest; see slidedp/run/checkpoint.py).
        `add(writer)`: a caller's own files into the same checkpoint, before the manifest (called in
        the process that writes it: under torchrun, rank 0's)."""
        self._check_open()
        self._check_whole_step("saved")
        self.runner.sync_host()
        if self.host.sharded:  # several hosts: each writes its share, rank 0 commits (a shared folder)
            comm = self.runner.comm
            write_sharded_checkpoint(self, dir, comm, lambda h: host_runs(
                self.plan, comm.world_size, h, comm.local_world_size), add=add)
            return
        if self._launched_rank() in (None, 0):  # under torchrun rank 0 writes, the others wait
            with atomic_checkpoint(dir) as writer:
                write_engine_state(self, writer)
                if add is not None:
                    add(writer)
        self._barrier()

    def load_checkpoint(self, dir, *, verify: bool = True) -> None:
        """Restore a checkpoint of `save_checkpoint` (every file is verified first, unless `verify`
        is False: the caller did); the model must have the same parameters. The optimizer settings
        stay those given to `compile`. A checkpoint written with any number of hosts loads on any
        other: each host reads the runs it holds."""
        self._check_open()
        rank = self._launched_rank()
        if rank is None:
            read_engine_state(self, dir, verify=verify)
            return
        # under torchrun rank 0 checks every file; each host's first rank reads what its host holds
        error = None
        if rank == 0 and verify:
            try:
                check_engine_checkpoint(self, dir)
            except CheckpointError as exc:
                error = str(exc)
        error = self.runner.comm.share(error)
        if error is not None:
            raise CheckpointError(error)
        meta, rng = check_engine_checkpoint(self, dir, verify=False)
        self.runner.flush()
        if self.runner.leader:
            read_state_arrays(self, dir, meta)
        self._barrier()
        apply_engine_meta(self, dir, meta, rng if rank == 0 else None)
        self.reload()

    def _launched_rank(self) -> int | None:
        """This process's rank when every rank is a process of its own (torchrun), else None."""
        return self.runner.rank if isinstance(self.runner, Rank) and self.runner.comm is not None else None

    def _barrier(self) -> None:
        if self._launched_rank() is not None:
            self.runner.comm.barrier()

    def export_hf(self, dir, *, tokenizer=None, dtype: str | None = None) -> None:
        """A `save_pretrained` folder of the model (Hugging Face models), with `tokenizer` saved beside
        it when given; the weights in `dtype`: "bf16", or "fp32" (the master weights exactly), None:
        the engine's precision (as the model was trained to run). Files readable by others (0666
        less the umask). Under torchrun a collective of every rank: rank 0 writes the folder (with
        several hosts, from the layers gathered one at a time, each kept in the export's dtype)."""
        self._check_open()
        self._check_whole_step("exported")
        dtype = self.precision if dtype is None else dtype
        self.runner.sync_host()
        writes = self._launched_rank() in (None, 0)
        weights: dict[str, torch.Tensor] = {}
        export_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype, torch.float32)
        for layer in self.graph.layers:
            views = self.master_views(layer.id)
            if not writes:
                continue
            arrays = self.host.layers[layer.id]
            for p in layer.params:
                # a device master: down a piece at a time, cast there, in the export's dtype
                value = to_host(views[p.name], export_dtype) if arrays.layout.lean else (
                    views[p.name] if arrays.whole else views[p.name].to(export_dtype))
                for name in (p.name, *p.aliases):
                    weights[name] = value
        if writes:
            for name, p in self.model.named_parameters(remove_duplicate=False):
                weights.setdefault(name, p.detach().float().cpu())
            save_hf(self.model, weights, dir, dtype=dtype, tokenizer=tokenizer)
        self._barrier()


def _empty_host_cache() -> None:
    """Give the pinned host blocks that torch's caching host allocator keeps (staging buffers) back."""
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def update_order(plan: Plan, graph: LayerGraph) -> list[int]:
    """The plan's update order (every layer once), or prologue, blocks, epilogue for a plan without one."""
    default = [graph.prologue.id] + [b.id for b in graph.blocks] + [graph.epilogue.id]
    order = list(plan.update_order) or default
    if sorted(order) != sorted(default):
        raise ValueError(f"the plan's update_order {order} is not a permutation of the layer ids {default}")
    return order
