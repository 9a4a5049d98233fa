"""The last two stages of `compile`: allocate (host state, weights) and launch (the ranks).

`launch(request, graph, plan, program)` checks memory before allocating anything (preflight), makes
the host state, writes the initial weights into it, and starts the ranks: the engine's own process
for one rank, worker processes for several, or this process as one rank under torchrun (on one
host, or one of several: each host's first rank makes that host's state, its other ranks map it).

With several hosts each host's state holds only its share: of every layer, the chunks its own ranks
own (backend/state/host_state.py host_runs), and only those are written from the initial weights;
the model's parameters of those layers are left on the meta device (no host holds them whole:
`Engine.state_dict` and `export_hf` gather them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from slidedp.backend.lowering.program import Program
from slidedp.backend.runtime import allocator
from slidedp.backend.runtime.comm import RankComm
from slidedp.backend.runtime.rank import build_rank
from slidedp.backend.runtime.workers import WorkerPool, job_skeleton
from slidedp.backend.state.device_state import DeviceState
from slidedp.backend.state.host_state import HostState, host_runs
from slidedp.backend.state.staging import copy_in_pieces_
from slidedp.backend.state.step_flags import StepFlags
from slidedp.budget import Budget
from slidedp.costmodel.hardware import Hardware
from slidedp.ir.graph import LayerGraph
from slidedp.logs import timed
from slidedp.optim import AdamW
from slidedp.run.engine import Engine, update_order
from slidedp.run.preflight import check_compile
from slidedp.run.weights import bind_parameters, fill_held_masters, fill_masters

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Request:
    """The arguments of `compile` / `plan`, checked and resolved (the input of every stage)."""

    model: nn.Module
    budget: Budget
    batch_size: int
    seq_len: int
    world_size: int
    device: torch.device
    precision: str  # "bf16" | "fp32"
    optimizer: AdamW
    max_grad_norm: float | None
    hardware: Hardware
    micro_batches: int
    compile_blocks: bool | None  # None: as a given plan says
    planning_only: bool = False
    host_memory_bytes: int | None = None  # host RAM the plan may take (None: plan unbounded, compile what is available)
    hosts: int = 1  # the hosts the ranks span (torchrun --nnodes)
    link_bytes_per_s: float = 0.0  # each host's rate into the network between hosts (hosts > 1)
    nonfinite: str = "skip"  # a non-finite gradient: "skip" the step or "stop" (NonFiniteGradientError)
    group_rows: bool | str = "auto"  # the plan may regroup the rank's rows into micro-batches (search/micro_rows.py)

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]


def in_engine_process(world_size: int) -> bool:
    """One rank, run in the engine's own process (SLIDEDP_WORKER_PROCESSES=1 puts it in a worker,
    which runs the multi-rank code path on a machine with one GPU; for diagnosis)."""
    return world_size == 1 and os.environ.get("SLIDEDP_WORKER_PROCESSES", "") in ("", "0")


def launched_rank(world_size: int) -> int | None:
    """This process's rank when torchrun (or a similar launcher) started one process per rank."""
    launched = os.environ.get("WORLD_SIZE")
    if world_size == 1 or launched is None:
        return None
    if int(launched) != world_size:
        raise ValueError(f"world_size={world_size}, but the launcher started WORLD_SIZE={launched} processes")
    launched_hosts(world_size)  # checks the hosts' layout
    return int(os.environ["RANK"])


def launched_hosts(world_size: int) -> int:
    """How many hosts the launcher's ranks span (WORLD_SIZE / LOCAL_WORLD_SIZE; 1 without a launcher).
    Every host runs the same number of ranks, numbered host by host (torchrun's layout)."""
    launched = os.environ.get("WORLD_SIZE")
    if world_size == 1 or launched is None:
        return 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", launched))
    if local < 1 or world_size % local:
        raise ValueError(f"world_size={world_size} is not a whole number of hosts of LOCAL_WORLD_SIZE={local} ranks")
    rank, group = int(os.environ["RANK"]), os.environ.get("GROUP_RANK")
    if group is not None and rank // local != int(group):
        raise ValueError(f"rank {rank} runs on host {group} (GROUP_RANK) but slidedp numbers the ranks host by host "
                         f"({local} per host): launch with torchrun, or number RANK = GROUP_RANK * {local} + LOCAL_RANK")
    return world_size // local


def connect(request: Request, rank: int) -> tuple[RankComm, torch.device]:
    """The process group of a launched rank, and its device."""
    dev = request.device
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    local = request.world_size // launched_hosts(request.world_size)
    return RankComm(rank, request.world_size, dev, init_method=None if dist.is_initialized() else "env://",
                    local_world_size=local), dev


def from_rank0(comm: RankComm, obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=comm.host_group)
    return box[0]


def check_hosts_routes(plan, hosts: int) -> None:
    """With several hosts a rank reads from its host's state only the chunks that its own host
    updates: every layer whose state is on the host must be delivered sharded (each owner copies its
    chunk, the GPUs broadcast it) and reduced on the GPUs (the owner alone copies the summed chunk
    down). Refuses any other route, naming the layers."""
    if hosts == 1:
        return
    bad = [d.name for d in plan.decisions if d.layer_id not in set(plan.device_state)
           and (d.delivery, d.reduction) != ("sharded", "gpu")]
    if bad:
        raise ValueError(f"with {hosts} hosts every layer streamed from the host needs sharded delivery and GPU "
                         f"reduction; the plan routes {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} otherwise "
                         "(plan with SolverOptions(deliveries=('sharded',), reductions=('gpu',)))")


def launch(request: Request, graph: LayerGraph, plan, program: Program, *, weights=None,
           rank: int | None = None, comm: RankComm | None = None, device: torch.device | None = None) -> Engine:
    """Allocate the host state, load the weights and start the ranks; returns the Engine.
    `rank`/`comm`/`device`: this process's rank under a launcher (None: the engine drives them)."""
    model, world_size, dev = request.model, request.world_size, device or request.device
    bf16 = request.precision == "bf16"
    if dev.type == "cuda" and rank is None and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size={world_size} needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    in_process = in_engine_process(world_size)
    if in_process or rank is not None:
        allocator.configure(dev, plan.budget_bytes)  # before this process's first CUDA allocation (the device state's)
    # the ranks that share this process's host state: all of them, or (several hosts) this host's
    local = comm.local_world_size if comm is not None else world_size
    leader = comm is None or comm.leader
    flag_ints = StepFlags.ints_needed(local, len(graph.layers))
    # the device state of an engine's own rank keeps its moments and gradient there alone
    lean = plan.device_state if in_process else ()
    # several hosts: this host's share of every layer streamed from the host
    held = host_runs(plan, world_size, comm.host_index, local) if comm is not None and comm.hosts > 1 else {}
    numels = [sum(hi - lo for lo, hi in held[layer.id]) if layer.id in held else layer.numel
              for layer in graph.layers] if held else None
    host = None
    if leader:
        check_compile(graph, plan, dev, precision=request.precision, world_size=local, control_ints=flag_ints,
                      lean_layers=lean, numels=numels)  # host RAM, /dev/shm, free device memory: refuse with numbers
        with timed("host state allocated"):
            host = HostState(graph, delivery_bf16=bf16, grad_dtype="bfloat16" if bf16 else "float32",
                             control_ints=flag_ints, spare_layers=plan.spare_layers(),
                             lean_layers=lean, no_copy_layers=plan.copies_made_on_load(),
                             no_grad_layers=plan.streamed_gradient_layers(), held=held)
    if rank is not None:
        handle = comm.from_leader(host.handle() if host is not None else None)
        host = host if leader else HostState.attach(handle)
    runner = None
    try:
        # the lean layers' state on the device from the start: their weights are loaded straight there
        device_state = DeviceState(host, lean, device=dev) if lean else None
        with timed("weights written"):
            load_weights(model, graph, host, bf16=bf16, copy=leader, weights=weights, device_state=device_state)
        if comm is not None:
            comm.barrier()  # rank 0 has written the weights
        model.eval()  # dropout off: recomputation must reproduce the forward exactly
        job = dict(graph=graph, plan=plan, program=program, compute_dtype=request.compute_dtype,
                   loss_chunk_tokens=plan.loss_chunk_tokens or None, update_order=update_order(plan, graph),
                   compile_blocks=plan.workload.compiled_blocks)
        if in_process or rank is not None:
            if dev.type == "cuda":
                with timed("host state pinned"):
                    host.pin()
            flags = None if comm is None else StepFlags(host.control(), local, len(graph.layers),
                                                         first_rank=comm.host_index * local)
            with timed("rank built"):
                runner = build_rank(model=model, host=host, device=dev, rank=rank or 0, world_size=world_size,
                                    comm=comm, flags=flags, device_state=device_state, **job)
        else:
            flags = StepFlags(host.control(), world_size, len(graph.layers))
            skeleton = job_skeleton(model=model, device=dev.type, host=host.handle(), **job)
            with timed("ranks started"):
                runner = WorkerPool(world_size=world_size, skeleton=skeleton, host=host, flags=flags)
    except BaseException:
        if runner is not None:
            runner.close()
        elif comm is not None:
            comm.close()
        if host is not None:
            host.close()
        raise
    return Engine(model=model, graph=graph, plan=plan, host=host, runner=runner, optimizer=request.optimizer,
                  max_grad_norm=request.max_grad_norm, device=dev, precision=request.precision,
                  nonfinite=request.nonfinite)


@torch.no_grad()
def load_weights(model: nn.Module, graph: LayerGraph, host: HostState, *, bf16: bool, copy: bool = True,
                 weights=None, device_state: DeviceState | None = None) -> None:
    """Write the initial weights into the host state (unless another rank did: `copy=False`), and
    those of the lean layers straight into the device's master (`device_state`, a piece at a time
    through a bounded host buffer: backend/state/staging.py): the model's own, or those of `weights`
    (slidedp/run/weights.py); then make the model's parameters views of them (bf16 parameters view
    the bf16 delivery copy, others the fp32 master; a lean layer's view the device's fp32 master), so
    nothing is held twice. A layer held in part here (several hosts) gets only its runs written, and
    its parameters become parameters on the meta device (the same object for every alias)."""
    masters, deliveries, on_device = {}, {}, set()
    partial = [layer for layer in graph.layers if not host.layers[layer.id].whole]
    if copy and partial:
        fill_held_masters(model, partial, {layer.id: host.layers[layer.id] for layer in partial}, weights)
        for layer in partial:
            arrays = host.layers[layer.id]
            if arrays.delivery is not None:
                arrays.delivery.copy_(arrays.master)
    for layer in graph.layers:
        arrays = host.layers[layer.id]
        if not arrays.whole:
            for p in layer.params:
                masters[p.name] = torch.empty(p.shape, dtype=torch.float32, device="meta")
            continue
        if arrays.layout.lean:
            views = device_state.param_views(layer.id)
            masters.update(views)
            on_device.update(views)
            continue
        masters.update(arrays.param_views(arrays.master))
        if arrays.delivery is not None:
            deliveries.update(arrays.param_views(arrays.delivery))
    if device_state is not None:  # what the lean layers' parameters were, for the model after close()
        device_state.param_dtypes = {name: model.get_parameter(name).dtype for name in on_device}
    if copy:
        whole = [layer for layer in graph.layers if host.layers[layer.id].whole]
        if weights is None:
            for name in (p.name for layer in whole for p in layer.params):
                copy_in_pieces_(masters[name], model.get_parameter(name))
        else:
            fill_masters(whole, masters, weights)
        for name, delivery in deliveries.items():
            delivery.copy_(masters[name])
    if device_state is not None:
        device_state.synchronize()  # the weights written there (by a function too) before any stream reads them
    views = {name: deliveries[name] if (bf16 and name in deliveries
                                        and model.get_parameter(name).dtype == torch.bfloat16) else master
             for name, master in masters.items()}
    bind_parameters(model, graph, views)
