"""The systems compared, one (system, tokens) point in one process: slidedp (compiled or eager blocks),
GPU-resident PyTorch, FSDP2 (with or without CPU offload) and DeepSpeed ZeRO-Offload (stage 2 or 3;
deepspeed_zero.py), on the same model and batches (`Point`),
and `worker`, which runs a point and writes its record, an error included."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common.hostmem import HostMemSampler, proc_status, reset_vm_hwm
from benchmarks.common.model import (BETAS, EPS, LR, SHAPES, WEIGHT_DECAY, batches, build_model,
                                     checkpoint_leading_blocks, empty_model, enable_checkpointing, fewest_checkpointed,
                                     init_value, n_params)
from benchmarks.common.profiles import host_prediction
from benchmarks.common.records import host_description
from benchmarks.common.steady import steady_fields

# -- one (system, tokens) point in this process ---------------------------------------------

class BuildPhases(logging.Handler):
    """While a system builds: slidedp's progress messages printed (INFO and up), and the phases it
    times (slidedp.logs.timed) collected, seconds by phase name."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.phases: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), flush=True)
        if hasattr(record, "phase"):
            self.phases[record.phase] = round(self.phases.get(record.phase, 0.0) + record.seconds, 3)

    @contextlib.contextmanager
    def attached(self):
        logger = logging.getLogger("slidedp")
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


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
        with BuildPhases().attached() as phases:
            step, finish, close = getattr(self, "setup_" + system)()
        self.record["build_s"] = time.perf_counter() - t0
        self.record["build_phases_s"] = phases.phases  # slidedp's own (the baselines time none)
        print(f"{system}: built in {self.record['build_s']:.1f} s", flush=True)  # progress, should the point time out
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
                print(f"{system}: warm-up step {self.record['warmup_s']:.2f} s", flush=True)
                if self.cuda:  # the warm-up's own peaks (first compilations), then the steps' apart
                    self.record["warmup_peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
                    self.record["warmup_peak_device_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
            times = []
            self.sync()
            self.record["measure_start_utc"] = utc_now()
            start = prev = time.perf_counter()
            for ids in self.data[warmup : warmup + self.args.steps]:
                losses.append(step(ids))
                now = time.perf_counter()
                times.append(now - prev)
                prev = now
                print(f"{system}: step {len(times)}/{self.args.steps} {times[-1]:.3f} s", flush=True)
            if finish:
                finish()  # slidedp: the last step's CPU update, started asynchronously
            self.sync()
            end = time.perf_counter()
            times[-1] += end - prev
            measured = (end - start) / self.args.steps  # every timed step, the first and the final flush included
            norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in self.grad_norms]
            self.record.update(
                measured_step_s=measured, step_times_s=times, **steady_fields(times, self.args.tokens),
                losses=losses, grad_norms=[float(n) for n in norms],
            )
            if self.cuda:  # from after the build: the warm-up's peak or the steps'
                steps_allocated, steps_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
                self.record.update(steps_peak_device_bytes=int(steps_allocated),
                                   steps_peak_device_reserved_bytes=int(steps_reserved))
                self.record["peak_device_bytes"] = max(int(steps_allocated),
                                                       self.record.get("warmup_peak_device_bytes", 0))
                self.record["peak_device_reserved_bytes"] = max(
                    int(steps_reserved), self.record.get("warmup_peak_device_reserved_bytes", 0))
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
            # the measurement is on disk before the teardown, which a host near its capacity may not survive
            self.record["teardown"] = "not finished"
            Path(self.args.result_file).write_text(json.dumps(self.record, indent=1))
        finally:
            close()
        self.record["teardown"] = "done"

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
                      max_grad_norm=a.max_grad_norm, hardware=self.slidedp_hardware(),
                      nonfinite=getattr(a, "nonfinite", "skip"),
                      group_rows=False)  # the rows per micro-batch the point asks for (a given plan's own)
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
            device_state_layers=list(engine.plan.device_state), nonfinite=engine.nonfinite,
            streamed_gradients=bool(engine.plan.streamed_gradients),
            optimizer="slidedp CPU AdamW (numba), fp32 master, bf16 weights out; layers of plan.device_state: "
                      "fused AdamW on the GPU",
        )
        plan_path = self.plan_path()
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        engine.plan.save(plan_path)
        # the prediction is fixed before the first step runs: its time, and the plan file it came from
        self.record.update(plan_path=str(plan_path), predicted_utc=utc_now(),
                           plan_sha256=hashlib.sha256(Path(plan if isinstance(plan, (str, Path)) else plan_path)
                                                      .read_bytes()).hexdigest())
        if getattr(a, "host_profile", None):  # also before the first step: the plan under this host's own figures
            self.record.update(host_prediction(engine.plan, engine.graph, a.host_profile), host_predicted_utc=utc_now())
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

        # the benchmark needs no copies of the trained weights after the run
        return step, finish, lambda: engine.close(keep_weights=False)

    # -- GPU-resident PyTorch --
    def setup_gpu_resident(self):
        """Plain PyTorch at its best configuration that fits: fp32 parameters on the device, autocast to
        bf16, fused AdamW, each decoder block compiled (`--baseline-compile`, default on CUDA) and
        activation checkpointing on as few leading blocks as fit (`--baseline-checkpoint auto`: probed,
        one forward and backward of the first batch per try, the optimizer state already allocated)."""
        torch, a = self.torch, self.args
        model = build_model(a.shape, dtype=torch.float32, device=self.dev, init_device=self.init_device(),
                            seed=a.seed)
        model.train()
        blocks = list(model.model.layers)
        compiled = self.cuda if a.baseline_compile is None else a.baseline_compile
        if compiled:
            for block in blocks:
                block.compile()
        fused = self.cuda  # CPU smoke: plain AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                fused=fused, foreach=None if fused else False)
        for p in model.parameters():  # what the first step would allocate, so that the probes count it
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        self.record.update(params=n_params(model), compiled_blocks=compiled,
                           optimizer=f"torch.optim.AdamW(fused={fused}) on {self.dev.type}")
        if self.cuda:
            self.record["precision"] = "fp32 parameters, torch.autocast(cuda, bfloat16)"

            def autocast():
                return torch.autocast("cuda", dtype=torch.bfloat16)
        else:
            self.record["precision"] = "fp32"
            autocast = contextlib.nullcontext

        zero_grad = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
        step = self.baseline_step_fn(model, opt.step, zero_grad, autocast)
        probe = self.baseline_step_fn(model, lambda: None, zero_grad, autocast)

        def fits(k: int) -> bool:
            checkpoint_leading_blocks(model, k)
            try:
                probe(self.data[0])
                ok = True
            except self.oom_errors():
                ok = False
            zero_grad()
            self.grad_norms.clear()
            if self.cuda:
                torch.cuda.empty_cache()
            return ok

        how = a.baseline_checkpoint
        if how == "auto":
            k, tried = fewest_checkpointed(len(blocks), fits)
            self.record["checkpoint_probes"] = tried
        else:
            k = {"all": len(blocks), "none": 0}.get(how, None)
            k = int(how) if k is None else k
        checkpoint_leading_blocks(model, k)
        self.record.update(checkpointed_blocks=k, activation_checkpointing=(
            f"non-reentrant on blocks 0..{k - 1} of {len(blocks)}" if k else f"none (0 of {len(blocks)} blocks)"))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return step, None, lambda: None

    def oom_errors(self) -> tuple:
        torch = self.torch
        return (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError, MemoryError)

    # -- DeepSpeed ZeRO-Offload (benchmarks/common/deepspeed_zero.py) --
    def setup_deepspeed_zero2_offload(self):
        from benchmarks.common import deepspeed_zero

        return deepspeed_zero.setup(self, "deepspeed_zero2_offload")

    def setup_deepspeed_zero3_offload(self):
        from benchmarks.common import deepspeed_zero

        return deepspeed_zero.setup(self, "deepspeed_zero3_offload")

    def setup_deepspeed_zero3_offload_param(self):
        from benchmarks.common import deepspeed_zero

        return deepspeed_zero.setup(self, "deepspeed_zero3_offload_param")

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


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the microsecond."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def base_record(system: str, tokens: int, args) -> dict:
    """Every required key, numbers null until measured."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "system": system, "tokens_per_step": tokens, "tokens_per_s": None, "peak_device_bytes": None,
        "peak_host_bytes": None, "measured_step_s": None, "predicted_step_s": None, "budget_bytes": None,
        "date": now.date().isoformat(), "time_utc": now.isoformat(timespec="seconds"), "command": args.command,
        "shape": args.shape, "device": args.device, "seed": args.seed, "steps": args.steps,
        "baseline_micro_rows": args.baseline_micro_rows, "max_grad_norm": args.max_grad_norm,
        "nonfinite": getattr(args, "nonfinite", "skip"), "checkpoint_setting": checkpoint_setting(system, args),
        "error": None,
    }


def checkpoint_setting(system: str, args) -> str | None:
    """The activation checkpointing asked of a baseline (--baseline-checkpoint for GPU-resident,
    --deepspeed-checkpoint for DeepSpeed: auto, all, none or a number of blocks); None where it is not
    a choice (slidedp's plan decides, FSDP2 checkpoints every block)."""
    if system == "gpu_resident":
        return getattr(args, "baseline_checkpoint", "auto")
    if system.startswith("deepspeed_"):
        return getattr(args, "deepspeed_checkpoint", "auto")
    return None


def worker(args, record: dict, point_cls=None, sampler=None) -> int:
    """One point in this process (a `point_cls`, default Point), filling `record` (the harness's record
    with every required key, numbers null); the record goes to --result-file."""
    sampler = sampler or HostMemSampler()
    code = 0
    try:
        import torch
        import transformers

        record.update(torch=torch.__version__, transformers=transformers.__version__, device=args.device,
                      device_name=(torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda")
                                   else host_description()["host_cpu"]),
                      cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                      slidedp_cap_reserved=os.environ.get("SLIDEDP_CAP_RESERVED") == "1")
        try:
            import slidedp

            record["slidedp"] = slidedp.__version__
        except ImportError:
            pass
        point = (point_cls or Point)(args)
        point.record = record
        # Every system on the allocator slidedp's ranks use: expandable segments, unless the environment
        # configures it. A fixed-segment cache left DeepSpeed 9.9 GiB reserved but unusable for a 9.3 GiB
        # allocation (benchmarks/LOG.md, 2026-12-06), and the checkpointing probes measure what fits.
        from slidedp.backend.runtime.allocator import expandable_segments

        record["cuda_expandable_segments"] = expandable_segments(point.dev)
        record.update(seq_len=point.seq, micro_batches=point.rows)
        point.run(args.system, sampler)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a record
        if record.get("teardown") == "not finished":  # measured: the failure is the teardown's
            record["teardown_error"] = error_text(exc)
            traceback.print_exc()
            return _write(args, record, sampler)
        record["error"] = error_text(exc)
        record["traceback"] = traceback.format_exc()[-4000:]
        for key in ("tokens_per_s", "measured_step_s", "median_step_s", "mean_step_s", "peak_device_bytes",
                    "peak_host_bytes"):
            record[key] = None
        traceback.print_exc()
        code = 1
    return _write(args, record, sampler, code)


def _write(args, record: dict, sampler, code: int = 0) -> int:
    sampler.stop()
    record["host_used_bytes_incl_build"] = sampler.peak_all - sampler.base
    Path(args.result_file).write_text(json.dumps(record, indent=1))
    return code


