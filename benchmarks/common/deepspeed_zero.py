"""DeepSpeed ZeRO-Offload as a baseline: ZeRO stage 2 or 3 with the optimizer state (fp32 master
weights and Adam moments) in pinned host memory, updated by DeepSpeed's CPU Adam (DeepSpeedCPUAdam,
a C++ op JIT-compiled with ninja on first use), bf16 weights on the GPU; for ZeRO-3 optionally the
parameters offloaded too (`offload_param`). One process, one rank, no launcher: the process group
(NCCL on CUDA, gloo on the CPU) is set up here on a free local port.

DeepSpeed is optional (`pip install -e '.[deepspeed]'`; for the GPU machine without network,
benchmarks/common/deepspeed_wheels.sh prepares the wheels to carry). Everything that does not need it
(the systems, the config dict, how a failure reads in the record) is importable without it, and is
what tests/benchmarks/test_deepspeed_zero.py checks."""

from __future__ import annotations

import os
import socket
import time

# The version the benchmark was written against and deepspeed_wheels.sh carries.
DEEPSPEED_VERSION = "0.19.8"

# system name: (ZeRO stage, parameters offloaded to the CPU as well)
SYSTEMS = {
    "deepspeed_zero2_offload": (2, False),
    "deepspeed_zero3_offload": (3, False),
    "deepspeed_zero3_offload_param": (3, True),
}
NAMES = {
    "deepspeed_zero2_offload": "DeepSpeed ZeRO-2 + CPU offload",
    "deepspeed_zero3_offload": "DeepSpeed ZeRO-3 + CPU offload",
    "deepspeed_zero3_offload_param": "DeepSpeed ZeRO-3 + CPU offload (optimizer and parameters)",
}

# ZeRO-2's gradient buckets, in elements: DeepSpeed's documented ZeRO-Offload setting (5e8); with
# overlap_comm the reduce bucket is double-buffered (2 x 5e8 x 2 bytes = 2 GB of bf16 on the device).
ZERO2_BUCKET = 500_000_000


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here, with the text its record's "error" should say (record_text:
    common/systems.py's error_text uses it as it is, not cut to its first 1000 characters)."""

    def __init__(self, record_text: str):
        super().__init__(record_text)
        self.record_text = record_text


def zero_offload_config(stage: int, *, micro_rows: int, accumulation_steps: int, max_grad_norm: float | None,
                        hidden: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                        bf16: bool = True, offload_param: bool = False, pin_memory: bool = True,
                        world_size: int = 1) -> dict:
    """The DeepSpeed config of ZeRO-`stage` with the optimizer offloaded to the CPU (DeepSpeedCPUAdam,
    AdamW mode), at its best for one GPU: overlapped communication, contiguous gradients, large
    buckets; ZeRO-3 with Hugging Face's sizes for a hidden size `hidden` (`auto` in its integration:
    reduce bucket hidden^2, prefetch 0.9 hidden^2, parameters under 10 hidden elements kept whole).
    One step = `accumulation_steps` micro-batches of `micro_rows` rows; clipping to `max_grad_norm`
    (None: no clipping, DeepSpeed's 0)."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO-Offload is stage 2 or 3, not {stage}")
    if offload_param and stage != 3:
        raise ValueError("offload_param is ZeRO-3 only")
    if micro_rows < 1 or accumulation_steps < 1 or world_size < 1:
        raise ValueError("micro_rows, accumulation_steps and world_size must be positive")
    zero: dict = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": pin_memory},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 2:
        zero.update(reduce_scatter=True, reduce_bucket_size=ZERO2_BUCKET, allgather_bucket_size=ZERO2_BUCKET,
                    allgather_partitions=True)
    else:
        zero.update(
            reduce_bucket_size=hidden * hidden,
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
            stage3_param_persistence_threshold=10 * hidden,
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            sub_group_size=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=False,
        )
        if offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {
        "train_micro_batch_size_per_gpu": micro_rows,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro_rows * accumulation_steps * world_size,
        "gradient_clipping": 0.0 if max_grad_norm is None else float(max_grad_norm),
        "bf16": {"enabled": bool(bf16)},
        "zero_optimization": zero,
        # DeepSpeed chooses DeepSpeedCPUAdam for an offloaded Adam(W) (torch_adam false); adam_w_mode:
        # decoupled weight decay, as torch.optim.AdamW
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                  "weight_decay": weight_decay, "torch_adam": False,
                                                  "adam_w_mode": True}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def import_deepspeed():
    """deepspeed, or BaselineUnavailable saying how to install it and what the import raised."""
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - ImportError, or an import-time failure of its own
        raise BaselineUnavailable(
            f"deepspeed not importable ({type(exc).__name__}: {str(exc)[:2000]}); install it with "
            f"pip install -e '.[deepspeed]' (deepspeed=={DEEPSPEED_VERSION}), or on a machine without network "
            "from the wheels of benchmarks/common/deepspeed_wheels.sh") from exc
    return deepspeed


def build_failure_text(exc: BaseException, limit: int = 6000) -> str:
    """What the record says when DeepSpeedCPUAdam's op does not build: the exception's first line
    and the tail of its text (torch's cpp_extension puts the ninja / compiler output in it)."""
    msg = str(exc)
    text = f"DeepSpeedCPUAdam op (cpu_adam) failed to build or load: {type(exc).__name__}: "
    if len(msg) <= limit:
        return text + msg
    text += msg.splitlines()[0] + "\n...\n" + msg[-limit:]
    return text


def load_cpu_adam() -> float:
    """JIT-build (or load from the torch extensions cache) DeepSpeed's cpu_adam op; its seconds.
    A failure raises BaselineUnavailable with the build's output."""
    from deepspeed.accelerator import get_accelerator

    t = time.perf_counter()
    try:
        get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - the compiler's error goes into the record
        raise BaselineUnavailable(build_failure_text(exc)) from exc
    return time.perf_counter() - t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(point, system: str):
    """The DeepSpeed point of `system` for a common/systems.py Point: (step, finish, close)."""
    from benchmarks.common.model import BETAS, EPS, LR, WEIGHT_DECAY, build_model, checkpoint_leading_blocks, \
        fewest_checkpointed, n_params

    stage, offload_param = SYSTEMS[system]
    torch, a = point.torch, point.args
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    rec = point.record
    rec.update(deepspeed=deepspeed.__version__, deepspeed_accelerator=get_accelerator()._name,
               zero_stage=stage, offload_param=offload_param)
    if point.cuda:
        torch.cuda.set_device(point.dev.index or 0)
    rec["cpu_adam_build_s"] = load_cpu_adam()

    micro = a.baseline_micro_rows
    if point.rows % micro:
        raise ValueError(f"--baseline-micro-rows {micro} does not divide {point.rows} rows per step")
    accumulation = point.rows // micro
    bf16 = point.cuda  # the CPU smoke runs fp32, as the other systems do there
    config = zero_offload_config(stage, micro_rows=micro, accumulation_steps=accumulation,
                                 max_grad_norm=a.max_grad_norm, hidden=point.shape["hidden"], lr=LR, betas=BETAS,
                                 eps=EPS, weight_decay=WEIGHT_DECAY, bf16=bf16, offload_param=offload_param,
                                 pin_memory=point.cuda)
    rec["deepspeed_config"] = config
    rec["precision"] = ("bf16 parameters and gradients on the device (DeepSpeed bf16), fp32 master and Adam "
                        "moments on the CPU" if bf16 else "fp32")

    # One rank, no launcher: the environment a launcher would set, and the process group.
    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if point.cuda else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rec["process_group"] = f"{backend}, world size 1 (deepspeed.init_distributed, no launcher)"
    engine = None
    try:
        # The same bf16-rounded initial values as every system; DeepSpeed's fp32 master is made from
        # these weights, so it holds them exactly.
        dtype = torch.bfloat16 if bf16 else torch.float32
        model = build_model(a.shape, dtype=dtype, device=point.dev, init_device=point.init_device(), seed=a.seed)
        model.train()
        rec["params"] = n_params(model)
        blocks = len(model.model.layers)
        ids0 = point.data[0][:micro].to(point.dev)

        def fits(k: int) -> bool:
            """One forward and backward of a micro-batch with blocks 0..k-1 checkpointed, on the bare
            model: its whole gradient held on the device, more than ZeRO's buckets, so what fits here
            fits under DeepSpeed (the probe errs towards checkpointing)."""
            checkpoint_leading_blocks(model, k)
            try:
                logits = model(input_ids=ids0, use_cache=False).logits
                torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                  ids0[:, 1:].reshape(-1)).backward()
                ok = True
            except point.oom_errors():
                ok = False
            logits = None
            model.zero_grad(set_to_none=True)
            if point.cuda:
                torch.cuda.empty_cache()
            return ok

        how = getattr(a, "deepspeed_checkpoint", "auto")
        if how == "auto":
            k, tried = fewest_checkpointed(blocks, fits)
            rec["checkpoint_probes"] = tried
        else:
            k = {"all": blocks, "none": 0}.get(how)
            k = int(how) if k is None else k
        checkpoint_leading_blocks(model, k)
        rec.update(checkpointed_blocks=k, activation_checkpointing=(
            f"non-reentrant on blocks 0..{k - 1} of {blocks}" if k else f"none (0 of {blocks} blocks)"))

        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
        del model
        basic = getattr(optimizer, "optimizer", optimizer)
        rec["optimizer"] = (f"{type(basic).__module__}.{type(basic).__name__} (offload_optimizer cpu, "
                            f"pin_memory={point.cuda}) under {type(optimizer).__name__}")
    except BaseException:
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
        torch.distributed.destroy_process_group()
        raise

    def step(ids_all):
        n_tokens = ids_all.shape[0] * (ids_all.shape[1] - 1)
        loss_sum = torch.zeros((), dtype=torch.float32, device=point.dev)
        for r in range(0, ids_all.shape[0], micro):
            ids = ids_all[r:r + micro].to(point.dev, non_blocking=True)
            logits = engine(input_ids=ids, use_cache=False).logits
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                   ids[:, 1:].reshape(-1), reduction="sum")
            del logits
            # token-weighted over the whole step, as the other systems: no further division by the
            # number of micro-batches
            engine.backward(ce / n_tokens, scale_wrt_gas=False)
            engine.step()  # the optimizer step at the last micro-batch (the accumulation boundary)
            loss_sum += ce.detach()
        norm = engine.get_global_grad_norm()
        point.grad_norms.append(torch.tensor(float("nan") if norm is None else float(norm)))
        return float(loss_sum / n_tokens)

    def close():
        try:
            if hasattr(engine, "destroy"):
                engine.destroy()
        finally:
            torch.distributed.destroy_process_group()

    if point.cuda:
        torch.cuda.reset_peak_memory_stats()
    return step, None, close
