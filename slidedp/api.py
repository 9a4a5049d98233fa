"""`slidedp.plan` (solve, allocate nothing) and `slidedp.compile` (plan + lower + allocate)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from slidedp._version import __version__
from slidedp.backend.runtime.comm import RankComm
from slidedp.backend.state.host_state import HostState
from slidedp.backend.lowering.program import Program, lower
from slidedp.backend.runtime.rank import build_rank
from slidedp.backend.lowering.verify import simulate
from slidedp.backend.state.step_flags import StepFlags
from slidedp.backend.runtime.workers import WorkerPool, job_skeleton
from slidedp.budget import Budget
from slidedp.costmodel.hardware import resolve_hardware
from slidedp.run.engine import Engine, update_order
from slidedp.ir.build import build_layer_graph
from slidedp.ir.graph import BLOCK, LayerGraph
from slidedp.optim import AdamW
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.plan import Plan
from slidedp.scheduler.solve import solve_plan
from slidedp.run.weights import bind_parameters, check_weights_source, fill_masters, tie_meta_model

_PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _resolve_device(device: str) -> torch.device:
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    return torch.device(device)


def _prepare(model, budget, *, batch_size, seq_len, world_size, device, precision, optimizer,
             max_grad_norm, hardware, plan, micro_batches, compile_blocks, planning_only=False,
             solver_options=None, host_memory=None):
    """Validate every argument and solve (or load) the plan; allocates nothing.

    `compile_blocks` None: a given plan's choice; else on CUDA (and, when only planning, for any
    GPU hardware profile) yes, on the CPU no. `solver_options`: a SolverOptions for the solve.
    Host RAM the plan may use beside the host state: what this machine has available, or when only
    planning `host_memory` (that of the machine the plan is for; None: unbounded)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    budget = Budget.parse(budget)
    batch_size = _positive_int("batch_size", batch_size)
    seq_len = _positive_int("seq_len", seq_len)
    if seq_len < 2:
        raise ValueError("seq_len must be >= 2 (a next-token loss needs two tokens)")
    world_size = _positive_int("world_size", world_size)
    micro_batches = _positive_int("micro_batches", micro_batches)
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if optimizer is None:
        optimizer = AdamW()
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"optimizer must be a slidedp.AdamW, got {type(optimizer).__name__}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if compile_blocks is not None and not isinstance(compile_blocks, bool):
        raise TypeError(f"compile_blocks must be True, False or None, got {compile_blocks!r}")
    if solver_options is not None:
        if not isinstance(solver_options, SolverOptions):
            raise TypeError(f"solver_options must be a SolverOptions, got {type(solver_options).__name__}")
        if plan is not None:
            raise ValueError("solver_options and plan exclude each other: a given plan is not solved again")
    if host_memory is not None:  # (plan only: compile measures its own machine)
        try:
            host_memory = Budget.parse(host_memory).device_bytes
        except (TypeError, ValueError) as e:
            raise type(e)(f"host_memory: {e}") from None
    dev = _resolve_device(device)
    hw = resolve_hardware(hardware, dev.type)
    tie_meta_model(model)
    the_plan = None
    if plan is not None:
        the_plan = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
        if not isinstance(the_plan, Plan):
            raise TypeError(f"plan must be a slidedp.Plan or a path, got {type(plan).__name__}")
    elif compile_blocks is None:
        compile_blocks = dev.type == "cuda" or (planning_only and hw.name != "cpu")
    graph = build_layer_graph(model, batch_size=batch_size, seq_len=seq_len,
                              compute_dtype=_PRECISIONS[precision],
                              compiled_blocks=the_plan.workload.compiled_blocks if the_plan else compile_blocks)
    if the_plan is not None:
        check_plan_matches(the_plan, graph, world_size=world_size, precision=precision,
                           compiled_blocks=compile_blocks)
        if the_plan.early_order and not _early_allowed(world_size, max_grad_norm):
            raise ValueError("the plan updates each layer during the backward (early_order), which needs "
                             "max_grad_norm=None and one rank in this process; solve a plan for this run")
        streamed, elsewhere = set(the_plan.streamed_updates), set(the_plan.device_state) | set(the_plan.early_order)
        if streamed - set(range(len(graph.layers))) or streamed & elsewhere:
            raise ValueError(f"the plan's streamed_updates {the_plan.streamed_updates} must be layer ids whose state "
                             "lives on the host and that are not updated early (device_state, early_order)")
    else:
        from slidedp.run.preflight import host_available_bytes

        available = host_memory if planning_only else host_available_bytes()
        the_plan = solve_plan(graph, budget_bytes=budget.device_bytes, hardware=hw, world_size=world_size,
                              precision=precision, micro_batches=micro_batches, version=__version__,
                              compiled_blocks=compile_blocks, options=solver_options,
                              host_offload_bytes=_host_offload_bytes(graph, precision, available),
                              early_host_bytes=_early_host_bytes(graph, precision, available)
                              if _early_allowed(world_size, max_grad_norm) else None,
                              streamed_updates=hw.gpu_memory_bytes_per_s > 0)
    return graph, the_plan, dev, optimizer, max_grad_norm


def _one_process(world_size: int) -> bool:
    """One rank, run in the engine's own process (SLIDEDP_WORKER_PROCESSES=1 puts it in a worker)."""
    return world_size == 1 and os.environ.get("SLIDEDP_WORKER_PROCESSES", "") in ("", "0")


def _early_allowed(world_size: int, max_grad_norm) -> bool:
    """Early updates (backend/runtime/early_updates.py) need the whole gradient only for its finite check:
    not with clipping, and they run on one rank in the engine's own process."""
    return max_grad_norm is None and _one_process(world_size)


def _early_host_bytes(graph: LayerGraph, precision: str, available: int | None) -> int:
    """Host RAM the spare state of early updates may take: what is `available` beyond the host state
    and twice the preflight's headroom (not known: no limit; compile's preflight counts the spare
    state against what the machine has)."""
    from slidedp.run.preflight import HOST_HEADROOM_BYTES, host_state_bytes

    if available is None:
        return 1 << 62
    return max(0, available - host_state_bytes(graph, precision=precision) - 2 * HOST_HEADROOM_BYTES)


def _host_offload_bytes(graph: LayerGraph, precision: str, available: int | None) -> int | None:
    """Host RAM that offloaded activations may take on the machine: half of what is `available`
    beyond the host state compile will allocate and the preflight's headroom (None: unknown); the
    other half stays for the rest of the process (the model as built, compile workers, data). Seen
    on the H200 host: a 262,144-token plan offloading 41.7 GiB beside 70 GiB of host state was
    killed for host memory (then each offloaded tensor was pinned on its own, rounded up to a power
    of two; it now goes into one arena of the exact size, saved_activations.HostArena)."""
    from slidedp.run.preflight import HOST_HEADROOM_BYTES, host_state_bytes

    if available is None:
        return None
    return max(0, available - host_state_bytes(graph, precision=precision) - 2 * HOST_HEADROOM_BYTES) // 2


def check_plan_matches(plan: Plan, graph: LayerGraph, *, world_size: int, precision: str,
                       compiled_blocks: bool | None = None) -> None:
    """Refuse a plan made for another model, workload or world size, naming the difference
    (`compiled_blocks` None: whatever the plan says)."""
    w = plan.workload
    for name, planned, actual in (
        ("model fingerprint", plan.model_fingerprint, graph.fingerprint()),
        ("batch_size", w.batch_size, graph.batch_size),
        ("seq_len", w.seq_len, graph.seq_len),
        ("world_size", w.world_size, world_size),
        ("precision", w.precision, precision),
        ("compile_blocks", w.compiled_blocks, w.compiled_blocks if compiled_blocks is None else compiled_blocks),
    ):
        if planned != actual:
            raise ValueError(f"the plan was made for another workload: {name} is {planned!r} in the plan "
                             f"but {actual!r} here")
    if not set(plan.device_state) <= {layer.id for layer in graph.layers}:
        raise ValueError(f"the plan's device_state {list(plan.device_state)} must name layers of this model "
                         f"(layer ids 0..{len(graph.layers) - 1})")


def plan(model: nn.Module, budget, *, batch_size: int, seq_len: int, world_size: int = 1,
         device: str = "auto", precision: str = "bf16", optimizer: AdamW | None = None,
         max_grad_norm: float | None = None, hardware=None, plan=None, micro_batches: int = 1,
         compile_blocks: bool | None = None, solver_options: SolverOptions | None = None,
         host_memory: int | str | None = None) -> Plan:
    """Solve a schedule without allocating anything (works on a meta-device model).
    `compile_blocks` (see `compile`) None: yes for a GPU hardware profile, no for the CPU.
    `host_memory` (bytes or e.g. "125GiB"): the host RAM available (MemAvailable) on the machine the
    plan is for, before compile allocates there: bounds activation offload and early updates' spare
    state as compile would on that machine (None: unbounded; compile's preflight checks there).
    `solver_options` (slidedp.scheduler.decisions.SolverOptions): the values the solver may choose
    from, e.g. `SolverOptions(deliveries=("sharded",), reductions=("gpu",))` forces those routes
    (several ranks and GPU peer-to-peer needed, else ValueError); pass the plan to `compile(plan=)`."""
    if device == "auto":
        device = "cpu" if hardware is None and not torch.cuda.is_available() else device
    _, the_plan, *_ = _prepare(model, budget, batch_size=batch_size, seq_len=seq_len, world_size=world_size,
                               device=device, precision=precision, optimizer=optimizer,
                               max_grad_norm=max_grad_norm, hardware=hardware, plan=plan,
                               micro_batches=micro_batches, compile_blocks=compile_blocks, planning_only=True,
                               solver_options=solver_options, host_memory=host_memory)
    return the_plan


def compile(model: nn.Module, budget, *, batch_size: int, seq_len: int, world_size: int = 1,
            device: str = "auto", precision: str = "bf16", optimizer: AdamW | None = None,
            max_grad_norm: float | None = None, hardware=None, plan=None, micro_batches: int = 1,
            compile_blocks: bool | None = None, weights=None) -> Engine:
    """Trace, plan, and allocate: returns an Engine whose `step()` trains the model.

    `weights`: where the initial weights come from (slidedp/run/weights.py): None, the model's own
    parameters; a safetensors checkpoint folder or a function fn(name, out) filling each fp32
    master, for a model built with its parameters on the meta device
    (`accelerate.init_empty_weights()`), read straight into the host state.

    `micro_batches` is how many micro-batches per rank share one pass over the weights (more rows
    than that in `step()` run as several passes, gradients summed on the host).

    `compile_blocks`: run every block through `torch.compile` (backend/runtime/executor.py), and plan
    with the hardware's compiled block rate; None (default): as a given plan says, else on CUDA
    devices but not on the CPU, where compiling costs more than it saves.

    With `world_size` > 1 the ranks are worker processes (one per GPU, or CPU processes), started
    here and driven by this process: `step()` takes the global batch (backend/runtime/workers.py). Under
    `torchrun --nproc-per-node=W` (WORLD_SIZE=W in the environment) every process is one rank
    instead: each calls `compile` and `step` with the same arguments and global batch, and
    takes its share of the rows; rank 0's process holds the host state, the others map it.
    """
    launched_rank = _launched_rank(world_size)
    graph, the_plan, dev, optimizer, max_grad_norm = _prepare(
        model, budget, batch_size=batch_size, seq_len=seq_len, world_size=world_size, device=device,
        precision=precision, optimizer=optimizer, max_grad_norm=max_grad_norm, hardware=hardware,
        plan=plan, micro_batches=micro_batches, compile_blocks=compile_blocks)
    comm = None
    if launched_rank is not None:
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", launched_rank)))
            torch.cuda.set_device(dev)
        comm = RankComm(launched_rank, world_size, dev, init_method=None if dist.is_initialized() else "env://")
        the_plan = _from_rank0(comm, the_plan)  # one plan for all, whatever each process solved
    check_weights_source(model, graph, weights)
    program = lower_plan(graph, the_plan)
    # Happens-before, buffer lifetimes and peak memory within the budget, before anything is allocated
    # (for a solved plan the program needs at most the plan's predicted peak: tests/backend/test_program.py).
    simulate(program, budget_bytes=Budget.parse(budget).device_bytes)
    bf16 = precision == "bf16"
    if dev.type == "cuda" and launched_rank is None and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size={world_size} needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    flag_ints = StepFlags.ints_needed(world_size, len(graph.layers))
    from slidedp.run.preflight import check_compile  # host RAM, /dev/shm, free device memory: refuse with numbers
    host = None
    # SLIDEDP_WORKER_PROCESSES=1: one rank in a worker process too (runs the multi-rank code path
    # on a machine with one GPU; for diagnosis)
    in_process = _one_process(world_size)
    # the device state of an engine's own rank keeps its moments and gradient there alone
    lean = the_plan.device_state if in_process else ()
    if launched_rank is None or launched_rank == 0:
        check_compile(graph, the_plan, dev, precision=precision, world_size=world_size, control_ints=flag_ints,
                      lean_layers=lean)
        host = HostState(graph, delivery_bf16=bf16, grad_dtype="bfloat16" if bf16 else "float32",
                         control_ints=flag_ints, spare_layers=the_plan.early_order, lean_layers=lean)
    if launched_rank is not None:
        host = _share_host_state(comm, host)
    runner = None
    try:
        _load_weights(model, graph, host, bf16=bf16, copy=launched_rank in (None, 0), weights=weights)
        if comm is not None:
            comm.barrier()  # rank 0 has written the weights
        model.eval()  # dropout off: recomputation must reproduce the forward exactly
        job = dict(graph=graph, plan=the_plan, program=program, compute_dtype=_PRECISIONS[precision],
                   loss_chunk_tokens=the_plan.loss_chunk_tokens or None, update_order=update_order(the_plan, graph),
                   compile_blocks=the_plan.workload.compiled_blocks)
        if in_process or launched_rank is not None:
            if dev.type == "cuda":
                host.pin()
            flags = StepFlags(host.control(), world_size, len(graph.layers)) if comm is not None else None
            runner = build_rank(model=model, host=host, device=dev, rank=launched_rank or 0, world_size=world_size,
                                comm=comm, flags=flags, **job)
        else:
            flags = StepFlags(host.control(), world_size, len(graph.layers))
            skeleton = job_skeleton(model=model, device=dev.type, host=host.handle(), **job)
            runner = WorkerPool(world_size=world_size, skeleton=skeleton, host=host, flags=flags)
    except BaseException:
        if runner is not None:
            runner.close()
        elif comm is not None:
            comm.close()
        host.close()
        raise
    return Engine(model=model, graph=graph, plan=the_plan, host=host, runner=runner, optimizer=optimizer,
                  max_grad_norm=max_grad_norm, device=dev, precision=precision)


def lower_plan(graph: LayerGraph, plan: Plan) -> Program:
    """The Program of one pass over the weights, as the plan decides it."""
    return lower(graph, plan.schedule, micro_batches=plan.workload.micro_batches)


def _launched_rank(world_size: int) -> int | None:
    """This process's rank when torchrun (or a similar launcher) started one process per rank."""
    launched = os.environ.get("WORLD_SIZE")
    if world_size == 1 or launched is None:
        return None
    if int(launched) != world_size:
        raise ValueError(f"world_size={world_size}, but the launcher started WORLD_SIZE={launched} processes")
    if int(os.environ.get("LOCAL_WORLD_SIZE", launched)) != world_size:
        raise ValueError("slidedp's ranks share one host's memory: run every rank on one node "
                         f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')}, WORLD_SIZE={launched})")
    return int(os.environ["RANK"])


def _from_rank0(comm: RankComm, obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=comm.host_group)
    return box[0]


def _share_host_state(comm: RankComm, host: HostState | None) -> HostState:
    """Rank 0's host state, mapped by every launched rank."""
    handle = _from_rank0(comm, host.handle() if host is not None else None)
    return host if comm.rank == 0 else HostState.attach(handle)


@torch.no_grad()
def _load_weights(model: nn.Module, graph: LayerGraph, host: HostState, *, bf16: bool, copy: bool = True,
                  weights=None) -> None:
    """Write the initial weights into the host state (unless another rank did: `copy=False`): the
    model's own, or those of `weights` (slidedp/run/weights.py); then make the model's parameters views
    of it (bf16 parameters view the bf16 delivery copy, others the fp32 master), so nothing is held
    twice."""
    masters, deliveries = {}, {}
    for layer in graph.layers:
        arrays = host.layers[layer.id]
        masters.update(arrays.param_views(arrays.master))
        if arrays.delivery is not None:
            deliveries.update(arrays.param_views(arrays.delivery))
    if copy:
        if weights is None:
            for name, master in masters.items():
                master.copy_(model.get_parameter(name).detach().float())
        else:
            fill_masters(graph, masters, weights)
        for name, delivery in deliveries.items():
            delivery.copy_(masters[name])
    views = {name: deliveries[name] if (bf16 and model.get_parameter(name).dtype == torch.bfloat16) else master
             for name, master in masters.items()}
    bind_parameters(model, graph, views)
