"""Every system in the same run, on the same random-init model and the same batches: slidedp against
GPU-resident PyTorch and FSDP2 with CPU offload, Qwen3-4B shape, seq 4096, one H200.

    python benchmarks/h200_qwen3_4b.py --tokens 4096 16384 32768 \
        --systems slidedp gpu_resident fsdp2_cpu_offload --budget 40GiB --steps 3 \
        --out benchmarks/h200_qwen3_4b.json --readme
    python benchmarks/h200_qwen3_4b.py --render benchmarks/h200_qwen3_4b.json --readme  # table only
    python benchmarks/h200_qwen3_4b.py --solve-plans --hardware h200-sxm --tokens 4096 16384 32768 \
        --budget 40GiB   # pre-solve slidedp's plans where OR-Tools is installed (no GPU needed); then
    python benchmarks/h200_qwen3_4b.py ... --plan 'benchmarks/results/plans/qwen3_4b_{tokens}.json'
    python benchmarks/h200_qwen3_4b.py --shape tiny --device cpu --tokens 64 --out /tmp/x.json  # CPU smoke

The driver runs each (system, tokens) point in a fresh child process of this script (`--worker`), one
at a time: three 4.4 B-parameter training states do not fit in host RAM together, and a point that
crashes, runs out of memory or is killed becomes a record with an "error" and null numbers instead
of ending the run. The JSON list is rewritten after every point, so a killed run keeps what it has.

Same model, same batches. Every child builds the model on the meta device and then gives each
parameter its initial value from its own seeded generator (seed and parameter name), on the run's
device (CUDA on the GPU run, so 4.4 B values take well under a second): normal(0, 0.02) for
matrices, ones for the RMSNorm weights. The values are rounded to bf16, so fp32 copies (the
GPU-resident model, FSDP2's sharded parameters, slidedp's fp32 master) and bf16 copies (the model
handed to slidedp) hold bit-identical initial weights in every system. The batches are uniform
random token ids from a generator seeded per step. The rotary-embedding buffers are recomputed in
fp32 (they are not parameters and stay fp32 in every system). Warm-up step = step 1 of training, on
the same batch everywhere, so the first losses must agree to bf16 tolerance.

Systems (AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0, global gradient-norm clipping
to 1.0, loss = token-weighted mean next-token cross-entropy over the whole step, gradient
accumulation over micro-batches of 1 x seq rows):

* slidedp: `slidedp.compile(model, budget, batch_size=1, seq_len=seq, precision="bf16",
  micro_batches=tokens // seq, ...)`. The model is built in bf16 on the CPU: compile copies the
  weights into its host state and then makes the model's parameters views of that state, so a bf16
  model halves the temporary copy (8.8 GB instead of 17.6 GB for 4.4 B parameters) and loses nothing,
  the initial weights being bf16 values. The plan is saved beside the output
  (`results/plans/qwen3_<shape>_<tokens>.json`), its summary goes into the record.
* gpu_resident: plain PyTorch, fp32 parameters on the GPU, `torch.autocast("cuda", bf16)`,
  `torch.optim.AdamW(fused=True)` on the GPU, activation checkpointing of every block
  (non-reentrant).
* fsdp2_cpu_offload: one process, world size 1 (NCCL, plus gloo for CPU tensors), `fully_shard` on
  every decoder layer and then on the root with `CPUOffloadPolicy(pin_memory=True)` and
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `torch.optim.AdamW(fused=True)` on
  the CPU-resident DTensor parameters (if this torch cannot, the record's "optimizer" says so and
  names the for-loop AdamW used instead), activation checkpointing of every block.

On `--device cpu` (the smoke path for tests) slidedp runs in fp32, gpu_resident is the same model
and loop on the CPU without autocast and with plain AdamW (`fused=False`), and FSDP2 runs on a gloo
process group with `CPUOffloadPolicy(pin_memory=False)`.

Measured per point: 1 warm-up step, then `--steps` timed steps between two device synchronisations
(slidedp's asynchronous CPU update of the warm-up step is waited for before the timed region, that of
the last timed step inside it, so the region holds exactly `--steps` steps and updates);
measured_step_s is their mean, tokens_per_s = tokens_per_step / measured_step_s.
peak_device_bytes is `torch.cuda.max_memory_allocated()` from after the build to the end.
peak_host_bytes is the process's peak resident set size (VmHWM) over the same window: the counter is
reset after the build by writing 5 to /proc/self/clear_refs (the build's transient copies are in
peak_host_bytes_incl_build). VmHWM counts shared memory that the process has touched: slidedp's
host state is a memfd shared segment, and its pages count as RssShmem. Pinned buffers allocated by
the CUDA driver (cudaHostAlloc: FSDP2's pinned parameters and gradients, torch's pinned-memory
cache) are mapped by the driver and may not be counted in RSS at all, so host_used_bytes is also
recorded: the peak, over the window, of the whole machine's used memory (MemTotal - MemAvailable,
sampled every 50 ms) above its value when the child started, which counts every kind of page.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import zlib
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("slidedp", "slidedp_eager", "gpu_resident", "fsdp2_cpu_offload")
BASELINES = ("gpu_resident", "fsdp2_cpu_offload")
REQUIRED_KEYS = ("system", "tokens_per_step", "tokens_per_s", "peak_device_bytes", "peak_host_bytes",
                 "measured_step_s", "predicted_step_s", "budget_bytes", "date", "command")
README_BEGIN = "<!-- h200_qwen3_4b:begin -->"
README_END = "<!-- h200_qwen3_4b:end -->"
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-5, (0.9, 0.999), 1e-8, 0.0, 1.0
INIT_STD = 0.02

SHAPES = {
    # Qwen3-4B: 4,411,424,256 parameters (untied embedding and head)
    "4b": dict(hidden=2560, intermediate=9728, blocks=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
               seq=4096),
    # Qwen3-8B: 8,190,735,360 parameters (untied); its host state (16 bytes per parameter) is 122 GiB
    "8b": dict(hidden=4096, intermediate=12288, blocks=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
               seq=4096),
    # CPU smoke test
    "tiny": dict(hidden=64, intermediate=128, blocks=2, heads=4, kv_heads=2, head_dim=16, vocab=512, seq=32),
}


# -- model and data: identical in every system --------------------------------------------------------

def qwen3_config(shape: str):
    from transformers import Qwen3Config

    s = SHAPES[shape]
    cfg = Qwen3Config(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["blocks"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      vocab_size=s["vocab"], tie_word_embeddings=False, use_cache=False,
                      max_position_embeddings=max(s["seq"], 1 << 18))  # default RoPE: a bound only
    cfg._attn_implementation = "sdpa"  # the same attention kernels in every system
    return cfg


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def empty_model(shape: str, *, dtype, device):
    """Qwen3ForCausalLM of `shape`, its parameters (of `dtype`) on the meta device, its rotary buffers
    (fp32 inverse frequencies, computed on the CPU) on `device`."""
    import torch
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(shape)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    rotary = model.model.rotary_emb
    fresh = type(rotary)(config=cfg)
    for bname, buf in fresh.named_buffers(recurse=False):
        rotary._buffers[bname] = buf.to(device)
    return model


def init_value(name: str, shape, *, init_device, seed: int):
    """Parameter `name`'s initial value, bf16 on `init_device`: ones for RMSNorm weights (1-D; Qwen3 has
    no biases), else N(0, INIT_STD) from its own seeded generator, rounded to bf16."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16, device=init_device)
    gen = torch.Generator(device=init_device).manual_seed(param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32, device=init_device)
    value.normal_(0.0, INIT_STD, generator=gen)
    return value.to(torch.bfloat16)


def build_model(shape: str, *, dtype, device, init_device, seed: int):
    """Qwen3ForCausalLM of `shape` with parameters of `dtype` on `device`, initialised on `init_device`
    from one seeded generator per parameter and rounded to bf16 (see the module docstring)."""
    from torch import nn

    model = empty_model(shape, dtype=dtype, device=device)
    named = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            value = init_value(named[id(p)], tuple(p.shape), init_device=init_device, seed=seed)
            module._parameters[pname] = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=True)
            del value
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left}")
    return model


def batches(vocab: int, rows: int, seq: int, n: int, seed: int):
    import torch

    return [torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed * 7919 + 1 + i))
            for i in range(n)]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def enable_checkpointing(model) -> str:
    """Non-reentrant activation checkpointing of every decoder block, with whichever entry point this
    transformers has; returns which one was used. Checks that every block has it on."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        how = "activation_checkpointing_enable(use_reentrant=False)"
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        how = "gradient_checkpointing_enable(use_reentrant=False)"
    off = [i for i, layer in enumerate(model.model.layers) if not getattr(layer, "gradient_checkpointing", False)]
    if off:
        raise RuntimeError(f"activation checkpointing is off in blocks {off}")
    return how


# -- host memory ----------------------------------------------------------------------------------------

def _meminfo_used() -> int:
    vals = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                vals[key] = int(rest.split()[0]) * 1024
    return vals["MemTotal"] - vals["MemAvailable"]


def proc_status() -> dict[str, int]:
    """Memory lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_vm_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class HostMemSampler:
    """Peak of the machine's used memory (MemTotal - MemAvailable) above its value at start."""

    def __init__(self, period_s: float = 0.05):
        self.base = _meminfo_used()
        self.peak_all = self.peak_window = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s):
        while not self._stop.wait(period_s):
            self.sample()

    def sample(self):
        used = _meminfo_used()
        self.peak_all = max(self.peak_all, used)
        self.peak_window = max(self.peak_window, used)

    def reset_window(self):
        self.sample()
        self.peak_window = _meminfo_used()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.sample()


# -- the worker: one (system, tokens) point in this process ---------------------------------------------

class Point:
    def __init__(self, args):
        import torch

        self.args = args
        self.torch = torch
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.shape = SHAPES[args.shape]
        self.seq = args.seq or self.shape["seq"]
        if args.tokens % self.seq:
            raise ValueError(f"--tokens {args.tokens} is not a multiple of seq {self.seq}")
        self.rows = args.tokens // self.seq
        self.data = batches(self.shape["vocab"], self.rows, self.seq, args.steps + 1, args.seed)
        # data-parallel ranks: slidedp's world_size; the FSDP2 process group's rank and size, with
        # `init_method` (None: a free local port, for world size 1). multi_gpu_scaling.py sets them.
        self.rank, self.world_size, self.init_method = 0, 1, None
        self.record: dict = {}
        self.grad_norms: list = []  # per step, before clipping (tensors until the end of the run)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def init_device(self):
        return self.dev  # CUDA generators on the GPU run: every system initialises on the same device

    # The loss and gradient of one step, shared by both baselines: token-weighted mean cross-entropy
    # over the whole step, accumulated over micro-batches of `--baseline-micro-rows` x seq rows.
    # With W ranks (FSDP2), each holds its share of the step's rows (every rank as many): the loss is
    # divided by the whole step's tokens and multiplied by W, as FSDP2 averages the ranks' gradients.
    def baseline_step_fn(self, model, opt_step, zero_grad, autocast):
        """One training step of either baseline, as a function of the batch (this rank's rows)."""
        import torch.nn.functional as F

        torch = self.torch
        micro = self.args.baseline_micro_rows
        ranks = self.world_size

        def step(ids_all):
            n_tokens = ranks * ids_all.shape[0] * (ids_all.shape[1] - 1)
            zero_grad()
            loss_sum = torch.zeros((), dtype=torch.float32, device=self.dev)
            for r in range(0, ids_all.shape[0], micro):
                ids = ids_all[r:r + micro].to(self.dev, non_blocking=True)
                with autocast():
                    logits = model(input_ids=ids, use_cache=False).logits
                ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                                     reduction="sum")
                del logits
                (ce / n_tokens * ranks if ranks > 1 else ce / n_tokens).backward()
                loss_sum += ce.detach()
            clip = self.args.max_grad_norm  # None: the norm is taken (recorded), nothing is clipped
            self.grad_norms.append(torch.nn.utils.clip_grad_norm_(
                model.parameters(), float("inf") if clip is None else clip).detach())
            opt_step()
            if ranks > 1:
                torch.distributed.all_reduce(loss_sum)
            loss = loss_sum / n_tokens
            if hasattr(loss, "full_tensor"):  # a DTensor, should FSDP2 return one
                loss = loss.full_tensor()
            return float(loss)

        return step

    def run(self, system: str, sampler: HostMemSampler):
        torch = self.torch
        t0 = time.perf_counter()
        step, finish, close = getattr(self, "setup_" + system)()
        self.record["build_s"] = time.perf_counter() - t0
        # The measurement window starts here (after the build), as for every system.
        hwm_build = proc_status().get("VmHWM")
        self.record["vm_hwm_reset"] = reset_vm_hwm()
        sampler.reset_window()
        if self.cuda:
            torch.cuda.empty_cache()  # the build's temporaries (per-parameter init on the GPU)
            torch.cuda.reset_peak_memory_stats()
        try:
            losses, warmup = [], 0 if self.args.no_warmup else 1
            self.record["warmup_steps"] = warmup
            if warmup:
                t = time.perf_counter()
                losses.append(step(self.data[0]))  # warm-up = training step 1
                if finish:
                    finish()
                self.sync()
                self.record["warmup_s"] = time.perf_counter() - t
            times = []
            self.sync()
            start = prev = time.perf_counter()
            for ids in self.data[warmup : warmup + self.args.steps]:
                losses.append(step(ids))
                now = time.perf_counter()
                times.append(now - prev)
                prev = now
            if finish:
                finish()  # slidedp: the last step's CPU update, started asynchronously
            self.sync()
            end = time.perf_counter()
            times[-1] += end - prev
            measured = (end - start) / self.args.steps
            norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in self.grad_norms]
            self.record.update(
                measured_step_s=measured, step_times_s=times, tokens_per_s=self.args.tokens / measured,
                losses=losses, grad_norms=[float(n) for n in norms],
            )
            if self.cuda:
                self.record["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
                self.record["peak_device_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            status = proc_status()
            sampler.sample()
            self.record.update(
                # without the reset (vm_hwm_reset false) this is the whole process's peak, build included
                peak_host_bytes=status.get("VmHWM"),
                peak_host_bytes_incl_build=max(hwm_build or 0, status.get("VmHWM") or 0) or None,
                host_used_bytes=sampler.peak_window - sampler.base,
                proc_status_end={k: status[k] for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")
                                 if k in status},
            )
        finally:
            close()

    # -- slidedp --
    def setup_slidedp_eager(self):
        """slidedp with every block eager (`compile_blocks=False`): the same-run baseline of torch.compile."""
        return self.setup_slidedp(compile_blocks=False)

    def slidedp_hardware(self):
        """slidedp's hardware argument (a preset name, a profile path or a Hardware; None: detected)."""
        return self.args.hardware

    def slidedp_plan(self, model, budget, compile_blocks, kwargs):
        """The plan that compile reuses (a path, or a Plan), or None: compile solves it."""
        a = self.args
        return a.plan.format(tokens=a.tokens, shape=a.shape) if a.plan else None

    def plan_path(self) -> Path:
        """Where the plan of this point is saved."""
        return Path(self.args.plans_dir) / f"qwen3_{self.args.shape}_{self.args.tokens}.json"

    def setup_slidedp(self, compile_blocks=None):
        import slidedp

        torch, a = self.torch, self.args
        precision = a.precision or ("bf16" if self.cuda else "fp32")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        # parameters on the meta device, their values written straight into the host state (weights=):
        # the same values as build_model's, and no copy of the model beside its host state
        model = empty_model(a.shape, dtype=dtype, device="cpu")
        init_device = self.init_device()

        def weights(name, out):
            out.copy_(init_value(name, tuple(out.shape), init_device=init_device, seed=a.seed))

        self.record.update(params=n_params(model), precision=precision,
                           model_dtype_given_to_compile=str(dtype).replace("torch.", ""))
        budget = slidedp.Budget.parse(a.budget).device_bytes
        self.record["budget_bytes"] = budget
        # one pass over the weights per step: each rank's rows are its micro-batches
        rows = getattr(a, "slidedp_micro_rows", 1)  # multi_gpu_scaling.py passes its own arguments
        if self.rows % (rows * self.world_size):
            raise ValueError(f"--slidedp-micro-rows {rows} does not divide {self.rows} rows per step "
                             f"over {self.world_size} rank(s)")
        self.record["slidedp_micro_rows"] = rows
        kwargs = dict(batch_size=rows, seq_len=self.seq, device=self.dev.type, precision=precision,
                      micro_batches=self.rows // self.world_size // rows, world_size=self.world_size,
                      optimizer=slidedp.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                      max_grad_norm=a.max_grad_norm, hardware=self.slidedp_hardware())
        plan = self.slidedp_plan(model, budget, compile_blocks, kwargs)
        engine = slidedp.compile(model, budget, plan=plan, compile_blocks=compile_blocks, weights=weights, **kwargs)
        self.engine = engine
        # the worker processes' executors (world_size > 1) follow the plan
        self.record["compile_blocks"] = getattr(engine.executor, "compile_blocks", engine.plan.workload.compiled_blocks)
        del model  # the engine keeps it; its parameters are now views of the host state
        self.record.update(
            predicted_step_s=float(engine.plan.predicted_step_time_s),
            predicted_peak_device_bytes=int(engine.plan.peak_device_bytes),
            plan_summary=engine.plan.summary(), plan_reused=plan if isinstance(plan, (str, Path)) else None,
            device_state_layers=list(engine.plan.device_state),
            optimizer="slidedp CPU AdamW (numba), fp32 master, bf16 weights out; layers of plan.device_state: "
                      "fused AdamW on the GPU",
        )
        plan_path = self.plan_path()
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        engine.plan.save(plan_path)
        self.record["plan_path"] = str(plan_path)
        print(engine.plan.summary(), flush=True)

        def finish():
            updates = getattr(engine, "updates", None)
            if updates is not None:
                updates.flush()

        step_info = self.record.setdefault("step_info", [])

        def step(ids):
            loss = engine.step(ids)
            info = getattr(engine, "last_step", None)
            if info is not None:
                self.grad_norms.append(info.grad_norm)
                if dataclasses.is_dataclass(info):
                    step_info.append(dataclasses.asdict(info))
            return loss

        return step, finish, engine.close

    # -- GPU-resident PyTorch --
    def setup_gpu_resident(self):
        torch, a = self.torch, self.args
        model = build_model(a.shape, dtype=torch.float32, device=self.dev, init_device=self.init_device(),
                            seed=a.seed)
        model.train()
        self.record.update(params=n_params(model), activation_checkpointing=enable_checkpointing(model))
        fused = self.cuda  # CPU smoke: plain AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                fused=fused, foreach=None if fused else False)
        self.record["optimizer"] = f"torch.optim.AdamW(fused={fused}) on {self.dev.type}"
        if self.cuda:
            self.record["precision"] = "fp32 parameters, torch.autocast(cuda, bfloat16)"

            def autocast():
                return torch.autocast("cuda", dtype=torch.bfloat16)
        else:
            self.record["precision"] = "fp32"
            autocast = contextlib.nullcontext

        step = self.baseline_step_fn(model, opt.step, lambda: opt.zero_grad(set_to_none=True), autocast)
        return step, None, lambda: None

    # -- FSDP2 + CPUOffloadPolicy --
    def setup_fsdp2_cpu_offload(self):
        return self.setup_fsdp2(offload=True)

    def setup_fsdp2(self, offload: bool):
        """FSDP2 over `self.world_size` ranks (this process is `self.rank`), its parameters, gradients
        and AdamW state in pinned host memory (`offload`) or on the device."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        torch, a = self.torch, self.args
        if self.cuda:
            torch.cuda.set_device(self.dev.index or 0)
        init_method = self.init_method
        if init_method is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        # NCCL for FSDP2's collectives on the GPU; gloo for the CPU tensors: with CPU offload the
        # gradients are CPU DTensors, and clip_grad_norm_ reduces their norm over the process group.
        backend = "cpu:gloo,cuda:nccl" if self.cuda else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, init_method=init_method)
        try:
            mesh = init_device_mesh(self.dev.type, (self.world_size,))
            # Materialised on the device (as fully_shard would move it there anyway); fully_shard then
            # moves each shard to pinned host memory.
            model = build_model(a.shape, dtype=torch.float32, device=self.dev, init_device=self.init_device(),
                                seed=a.seed)
            model.train()
            self.record.update(params=n_params(model), activation_checkpointing=enable_checkpointing(model))
            policy = CPUOffloadPolicy(pin_memory=self.cuda) if offload else OffloadPolicy()
            if self.cuda:
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                self.record["precision"] = "fp32 sharded parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)"
            else:
                mp = MixedPrecisionPolicy()
                self.record["precision"] = "fp32"
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=mp)
            fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mp)
            self.record["offload_policy"] = (f"CPUOffloadPolicy(pin_memory={self.cuda})" if offload else
                                             "none: parameters, gradients and AdamW state on the device")
            self.record["process_group"] = f"{backend}, world size {self.world_size}"
        except BaseException:
            dist.destroy_process_group()
            raise
        def make_opt(fused: bool):
            return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                     fused=fused or None, foreach=None if fused else False)

        opt = make_opt(True)
        where = "CPU-resident" if offload else f"{self.dev.type}-resident"
        self.record["optimizer"] = f"torch.optim.AdamW(fused=True) on the {where} DTensor parameters"
        first = [True]

        def opt_step():
            nonlocal opt
            if not first[0]:
                return opt.step()
            first[0] = False
            try:
                return opt.step()
            except (RuntimeError, NotImplementedError) as exc:
                # Fused AdamW on CPU DTensors not supported by this torch: say so, and step with the
                # for-loop AdamW instead (the gradients are still there; nothing was updated).
                if "out of memory" in str(exc).lower():
                    raise
                opt = make_opt(False)
                self.record["optimizer"] = (f"torch.optim.AdamW(foreach=False) on the {where} DTensor parameters "
                                            f"(fused=True failed: {type(exc).__name__}: {str(exc)[:300]})")
                print(self.record["optimizer"], file=sys.stderr, flush=True)
                return opt.step()

        step = self.baseline_step_fn(model, opt_step, lambda: opt.zero_grad(set_to_none=True),
                                     contextlib.nullcontext)

        def close():
            try:
                opt.state.clear()
            finally:
                dist.destroy_process_group()

        return step, None, close


def error_text(exc: BaseException) -> str:
    import torch

    try:
        import slidedp

        if isinstance(exc, slidedp.InfeasibleBudgetError):
            return f"infeasible budget (smallest feasible: {exc.min_budget_bytes} bytes)"
    except ImportError:
        pass
    if getattr(exc, "record_text", None):  # an exception that says what the record should say
        return exc.record_text
    msg = str(exc)
    oom = (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError, MemoryError)
    if isinstance(exc, oom) or "out of memory" in msg.lower() \
            or "can't allocate memory" in msg.lower():
        return "out of memory"
    return f"{type(exc).__name__}: {msg[:1000]}"


def worker(args, point_cls=None, sampler=None, record=None) -> int:
    """One point in this process (a `point_cls`, default Point); its record goes to --result-file."""
    sampler = sampler or HostMemSampler()
    record = base_record(args.system, args.tokens, args) if record is None else record
    code = 0
    try:
        import torch
        import transformers

        record.update(torch=torch.__version__, transformers=transformers.__version__, device=args.device,
                      device_name=(torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda")
                                   else host_description()["host_cpu"]),
                      cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        try:
            import slidedp

            record["slidedp"] = slidedp.__version__
        except ImportError:
            pass
        point = (point_cls or Point)(args)
        point.record = record
        record.update(seq_len=point.seq, micro_batches=point.rows)
        point.run(args.system, sampler)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a record
        record["error"] = error_text(exc)
        record["traceback"] = traceback.format_exc()[-4000:]
        for key in ("tokens_per_s", "measured_step_s", "peak_device_bytes", "peak_host_bytes"):
            record[key] = None
        traceback.print_exc()
        code = 1
    finally:
        sampler.stop()
        record["host_used_bytes_incl_build"] = sampler.peak_all - sampler.base
    Path(args.result_file).write_text(json.dumps(record, indent=1))
    return code


def base_record(system: str, tokens: int, args) -> dict:
    """Every required key, numbers null until measured."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "system": system, "tokens_per_step": tokens, "tokens_per_s": None, "peak_device_bytes": None,
        "peak_host_bytes": None, "measured_step_s": None, "predicted_step_s": None, "budget_bytes": None,
        "date": now.date().isoformat(), "time_utc": now.isoformat(timespec="seconds"), "command": args.command,
        "shape": args.shape, "device": args.device, "seed": args.seed, "steps": args.steps,
        "baseline_micro_rows": args.baseline_micro_rows, "max_grad_norm": args.max_grad_norm, "error": None,
    }


# -- the driver -------------------------------------------------------------------------------------------

def run_point(system: str, tokens: int, args, command: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="h200_qwen3_4b_") as tmp:
        result = Path(tmp) / "record.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--system", system, "--tokens", str(tokens),
               "--shape", args.shape, "--device", args.device, "--budget", args.budget, "--steps", str(args.steps),
               "--seed", str(args.seed), "--plans-dir", args.plans_dir, "--result-file", str(result),
               "--command", command, "--baseline-micro-rows", str(args.baseline_micro_rows),
               "--slidedp-micro-rows", str(args.slidedp_micro_rows), "--max-grad-norm", str(args.max_grad_norm)]
        for opt in ("plan", "hardware", "precision", "seq"):
            if getattr(args, opt):
                cmd += ["--" + opt, str(getattr(args, opt))]
        if args.no_warmup:
            cmd.append("--no-warmup")
        print(f"\n=== {system}, {tokens} tokens/step ===", file=sys.stderr, flush=True)
        fallback = base_record(system, tokens, args)
        fallback["command"] = command
        return run_child(cmd, result, args.timeout_s, fallback)


def run_child(cmd: list[str], result: Path, timeout_s: float, fallback: dict) -> dict:
    """Run one point's child process, echoing its output, in its own session (a timeout kills it and
    everything it started); its record from `result`, else `fallback` with the error and the tail
    of its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # its own process group: a timeout kills all of it
    tail: deque[str] = deque(maxlen=40)

    def pump():
        for line in proc.stdout:
            tail.append(line)
            sys.stderr.write(line)
        sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:  # Ctrl-C or a kill of the driver: the child, in its own session, goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    reader.join(timeout=10)
    wall = time.perf_counter() - t0
    if result.exists() and not timed_out:
        record = json.loads(result.read_text())
    else:
        record = dict(fallback)
        if timed_out:
            record["error"] = f"timeout after {timeout_s} s"
        elif proc.returncode is not None and proc.returncode < 0:
            sig = -proc.returncode
            record["error"] = f"killed by signal {sig}" + (" (host out of memory?)" if sig == 9 else "")
        else:
            record["error"] = f"exit code {proc.returncode} without a record"
        record["output_tail"] = "".join(tail)[-4000:]
    record["child_wall_s"] = wall
    record["child_exit_code"] = proc.returncode
    return record

def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def host_description() -> dict:
    mem = None
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    return {"host_cpu": cpu, "host_cores": os.cpu_count(), "host_mem_bytes": mem}


def write_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(path)


def drive(args) -> int:
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    # A SIGTERM to the driver becomes an exception, so that the running child is killed with it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.out)
    records: list[dict] = []
    if args.merge and out.exists():
        records = json.loads(out.read_text())
    extra = {"git_commit": git_commit(), **host_description()}
    for tokens in args.tokens:
        for system in args.systems:
            record = run_point(system, tokens, args, command)
            record.update({k: v for k, v in extra.items() if k not in record})
            records = [r for r in records if (r["system"], r["tokens_per_step"]) != (system, tokens)] + [record]
            write_records(out, records)
            summary = record["error"] or (f"{record['tokens_per_s']:.0f} tokens/s, "
                                          f"{record['measured_step_s']:.3f} s/step, losses {record.get('losses')}")
            print(f"=== {system}, {tokens} tokens/step: {summary}", file=sys.stderr, flush=True)
    print(render_table(records))
    if args.readme:
        update_readme(Path(args.readme_path), render_section(records, out))
    return 0


# -- rendering ------------------------------------------------------------------------------------------

NAMES = {"slidedp": "slidedp", "slidedp_eager": "slidedp, eager blocks", "gpu_resident": "GPU-resident", "fsdp2_cpu_offload": "FSDP2 + CPU offload"}


def _gib(x) -> str:
    return "–" if x is None else f"{x / 2**30:.1f}"


def _num(x, fmt) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def steady_step_s(record: dict) -> float | None:
    """Median of the timed steps but the last (which also waits for slidedp's final CPU update, which a
    longer run hides behind its next step); None with fewer than three timed steps."""
    times = record.get("step_times_s") or []
    return statistics.median(times[:-1]) if len(times) >= 3 else None


def render_table(records: list[dict]) -> str:
    """Markdown table of the records: one row per (shape, tokens, system), ratios against each baseline
    of the same shape, tokens per step and clipping (records without max_grad_norm clipped at 1.0;
    without shape: 4b). A shape column when the records hold several shapes."""
    order = {s: i for i, s in enumerate(SYSTEMS)}

    def clip(r):
        return r.get("max_grad_norm", 1.0)

    def shape(r):
        return r.get("shape", "4b")

    several = len({shape(r) for r in records}) > 1
    rows = sorted(records, key=lambda r: (shape(r), r["tokens_per_step"], clip(r) is None, order.get(r["system"], 99),
                                          r["system"], r.get("budget_bytes") or 0))
    by_point = {(shape(r), r["tokens_per_step"], r["system"], clip(r)): r for r in records}
    head = ["shape"] * several + ["tokens/step", "system", "budget GiB", "tokens/s"] + [
        f"vs {NAMES[b]}" for b in BASELINES] + [
        "peak device GiB", "peak host GiB (VmHWM, steps / incl. build)", "host used GiB", "step s measured / predicted", "loss step 1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tps = r.get("tokens_per_s")
        ratios = []
        for b in BASELINES:
            base = by_point.get((shape(r), r["tokens_per_step"], b, clip(r)), {}).get("tokens_per_s")
            ratios.append(f"{tps / base:.2f}x" if tps and base else "–")
        if r.get("error"):
            speed = r["error"].splitlines()[0][:80]
        else:
            speed = _num(tps, ",.0f")
        losses = r.get("losses") or []
        step_s = f"{_num(r.get('measured_step_s'), '.3f')} / {_num(r.get('predicted_step_s'), '.3f')}"
        if steady_step_s(r) is not None:
            step_s += f" (steady {steady_step_s(r):.3f})"
        budget = _gib(r.get("budget_bytes")) if r["system"].startswith("slidedp") else "–"
        name = NAMES.get(r["system"], r["system"]) + (" (no clipping)" if clip(r) is None else "")
        if r.get("slidedp_micro_rows", 1) > 1:
            name += f" ({r['slidedp_micro_rows']}-row micro-batches)"
        cells = [shape(r)] * several + [f"{r['tokens_per_step']:,}", name, budget, speed, *ratios,
                                        _gib(r.get("peak_device_bytes")),
                                        f"{_gib(r.get('peak_host_bytes'))} / {_gib(r.get('peak_host_bytes_incl_build'))}",
                                        _gib(r.get("host_used_bytes")),
                                        step_s, _num(losses[0] if losses else None, ".5f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_section(records: list[dict], out_path: Path | str | None = None) -> str:
    """The README section: title, commands, hardware, table and how it was measured."""
    dates = sorted({r["date"] for r in records if r.get("date")})
    commands = sorted({r["command"] for r in records if r.get("command")})
    devices = sorted({r["device_name"] for r in records if r.get("device_name")})
    soft = sorted({f"torch {r['torch']}, transformers {r['transformers']}" for r in records if r.get("torch")})
    hosts = sorted({f"{r['host_cpu']}, {r['host_cores']} cores, {_gib(r.get('host_mem_bytes'))} GiB RAM"
                    for r in records if r.get("host_cpu")})
    commits = sorted({r["git_commit"] for r in records if r.get("git_commit")})
    budgets = sorted({r["budget_bytes"] for r in records if r.get("budget_bytes")})
    shapes = sorted({r.get("shape", "4b") for r in records})
    params = sorted({r["params"] for r in records if r.get("params")})
    title = "Every system in one run, Qwen3-4B shape, one H200" if shapes == ["4b"] else \
        f"Every system in one run, Qwen3 shapes {', '.join(shapes)}, one H200"
    lines = [f"## {title} ({', '.join(dates) or 'not run'})", ""]
    lines += [f"`{c}`" for c in commands]
    rel = None
    if out_path is not None:
        out_path = Path(out_path)
        with contextlib.suppress(ValueError):
            rel = out_path.resolve().relative_to(HERE)
    lines.append(f"(records: `{rel or (out_path.name if out_path else 'h200_qwen3_4b.json')}`; slidedp's plans: "
                 "where each command's `--plans-dir` put them, by default `results/plans/`)")
    lines += ["", f"Hardware: {'; '.join(devices) or '?'}; host {'; '.join(hosts) or '?'}; {'; '.join(soft)}"
              + (f"; commit {', '.join(commits)}" if commits else "") + "."]
    lines += [f"Model: Qwen3 shape `{', '.join(shapes)}`, {', '.join(f'{p:,}' for p in params)} parameters, "
              f"untied, random init; slidedp budget {', '.join(_gib(b) + ' GiB' for b in budgets) or '–'}.", ""]
    lines.append(render_table(records))
    micro = sorted({r.get("baseline_micro_rows", 1) for r in records})
    optimizers = sorted({f"{NAMES.get(r['system'], r['system'])}: {r['optimizer']}" for r in records
                         if r.get("optimizer")})
    notes = (
        "Same model and batches in every system: each parameter is initialised from its own seeded generator "
        "on the same device and rounded to bf16, so every system starts from bit-identical weights; the "
        "batches are seeded per step; the warm-up step is training step 1 on the same batch, so the step-1 "
        "losses must agree to bf16 tolerance. AdamW lr 1e-5 (weight decay 0), global clipping to 1.0, "
        "token-weighted loss, gradient accumulation over micro-batches of "
        f"{' / '.join(map(str, micro))} x seq rows in every system. GPU-resident: fp32 parameters, bf16 "
        "autocast, fused AdamW on the GPU, activation checkpointing of every block. FSDP2: `fully_shard` per "
        "block and on the root, `CPUOffloadPolicy(pin_memory=True)`, bf16 parameters / fp32 reduction, AdamW "
        "on the CPU, activation checkpointing of every block. Optimizers as run: " + "; ".join(optimizers) + ". "
        "Tokens/s over the timed steps after one warm-up step (slidedp's last asynchronous CPU update "
        "included); steady: the median of the timed steps but the last. Peak device = `torch.cuda.max_memory_allocated()` after the build; peak host = the "
        "process's VmHWM after the build (slidedp's shared-memory host state counts); host used = the machine's "
        "MemTotal - MemAvailable above its value when the point's process started, which also counts pinned "
        "buffers that the CUDA driver maps outside RSS. Ratios: tokens/s over the baseline's at the same tokens "
        "per step. Each point ran in its own process, one after the other."
    )
    lines += ["", textwrap.fill(notes, width=100, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines)


def update_readme(path: Path, section: str, begin: str = README_BEGIN, end: str = README_END) -> None:
    """Replace what is between the markers `begin` and `end` in `path` by `section` (the markers and
    section appended at the end if absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


# -- offline planning ---------------------------------------------------------------------------------------

def solve_plans(args) -> int:
    """Solve slidedp's plan of every --tokens point on a meta-device model (no GPU, no weights), for
    --hardware, and save them where the benchmark saves its plans, for `--plan` on a machine without
    OR-Tools."""
    import torch
    from transformers import Qwen3ForCausalLM

    import slidedp

    precision = args.precision or "bf16"
    seq = args.seq or SHAPES[args.shape]["seq"]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(args.shape))
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    # the eager system alone: its plan counts eager blocks' saved activations
    compile_blocks = False if "slidedp" not in args.systems and "slidedp_eager" in args.systems else None
    for tokens in args.tokens:
        rows = args.slidedp_micro_rows
        plan = slidedp.plan(model, args.budget, batch_size=rows, seq_len=seq, precision=precision,
                            micro_batches=tokens // seq // rows, hardware=args.hardware or "h200-sxm",
                            optimizer=slidedp.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                            max_grad_norm=args.max_grad_norm, compile_blocks=compile_blocks,
                            host_memory=args.host_ram)
        path = Path(args.plans_dir) / f"qwen3_{args.shape}_{tokens}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
        print(f"{path}: predicted {plan.predicted_step_time_s:.3f} s/step\n{plan.summary()}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens per step")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's, 4096)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke test)")
    p.add_argument("--budget", default="40GiB", help="slidedp's device-memory budget")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--no-warmup", action="store_true",
                   help="time from the first step (it then includes first-call costs; for runs of minutes a step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-grad-norm", type=lambda v: None if v.lower() == "none" else float(v), default=MAX_GRAD_NORM,
                   help="gradient clipping in every system (default 1.0); 'none': no clipping (the norm is still "
                        "taken), which lets slidedp update each layer during the backward (early updates)")
    p.add_argument("--out", default=str(HERE / "h200_qwen3_4b.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the records already in --out, replacing those of the points run now")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per (system, tokens) point")
    p.add_argument("--plan", help="slidedp: reuse pre-solved plans; template with {tokens} and {shape}")
    p.add_argument("--plans-dir", help="where slidedp's plans are saved (default: results/plans beside --out)")
    p.add_argument("--hardware", help="slidedp hardware preset or profile (default: detected)")
    p.add_argument("--precision", choices=["bf16", "fp32"], help="slidedp (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--baseline-micro-rows", type=int, default=1,
                   help="rows (of seq tokens) per micro-batch in the two baselines")
    p.add_argument("--slidedp-micro-rows", type=int, default=1,
                   help="rows (sequences) per slidedp micro-batch: batch_size of compile (default 1)")
    p.add_argument("--readme", action="store_true", help="(re)write the marked section of benchmarks/README.md")
    p.add_argument("--readme-path", default=str(HERE / "README.md"))
    p.add_argument("--render", metavar="JSON", help="only render the table of an existing records file")
    p.add_argument("--solve-plans", action="store_true", help="only solve and save slidedp's plans (no GPU)")
    p.add_argument("--host-ram", help="with --solve-plans: host RAM available on the machine that will run them "
                                      "(e.g. 125GiB, the H200 host's), bounding activation offload as there")
    # worker side (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.baseline_micro_rows < 1 or args.slidedp_micro_rows < 1 or min(args.tokens) < 1:
        p.error("--steps, --baseline-micro-rows, --slidedp-micro-rows and --tokens must be positive")
    if args.plans_dir is None:
        args.plans_dir = str(Path(args.out).resolve().parent / "results" / "plans")
    if args.render:
        records = json.loads(Path(args.render).read_text())
        print(render_table(records))
        if args.readme:
            update_readme(Path(args.readme_path), render_section(records, args.render))
        return 0
    if args.solve_plans:
        return solve_plans(args)
    if args.worker:
        args.tokens = args.tokens[0]
        return worker(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
