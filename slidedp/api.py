"""`slidedp.plan` (solve, allocate nothing) and `slidedp.compile`, each a call of named stages:

    request = check_request(...)         the arguments, checked and resolved (run/launch.Request)
    graph   = trace(request)             model -> layer IR (ir/build.py)
    plan    = make_plan(request, graph)  solve (scheduler/solve.py), or check a given plan
    program = lower_plan(graph, plan)    the plan's schedule -> stream/event ops (backend/lowering)
    verify(program, budget)              happens-before, buffers, peak memory (backend/lowering/verify.py)
    engine  = launch(request, ...)       preflight, host state, weights, ranks (run/launch.py)
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from slidedp._version import __version__
from slidedp.backend.lowering.program import Program, lower
from slidedp.backend.lowering.verify import verify_program
from slidedp.budget import Budget, format_bytes
from slidedp.costmodel.hardware import LINKS, resolve_link, resolve_hardware
from slidedp.ir.build import build_layer_graph
from slidedp.ir.graph import LayerGraph
from slidedp.logs import timed
from slidedp.optim import AdamW
from slidedp.options import CompileOptions, merge
from slidedp.run.engine import Engine
from slidedp.run.launch import (
    COMPUTE_DTYPES, Request, check_hosts_routes, connect, from_rank0, in_engine_process, launch, launched_hosts,
    launched_rank,
)
from slidedp.run.preflight import HOST_HEADROOM_BYTES, host_available_bytes
from slidedp.run.weights import check_weights_source, tie_meta_model
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.plan import Plan
from slidedp.scheduler.replay import replay
from slidedp.scheduler.search.micro_rows import AUTO, blocks_host_bound, check_group_rows, fastest_grouping, groupings
from slidedp.scheduler.solve import solve_plan

log = logging.getLogger("slidedp")


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


def dropout_settings(model: nn.Module) -> list[str]:
    """Where `model` would drop activations when training: its nn.Dropout modules with p > 0 and its
    config's dropout probabilities above 0 (Hugging Face: attention_dropout, resid_pdrop, ...)."""
    modules = [(name, m.p) for name, m in model.named_modules()
               if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    found = [f"{len(modules)} dropout module(s) ({modules[0][0]}, p={modules[0][1]:g})"] if modules else []
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    found += [f"config.{k}={v:g}" for k, v in items
              if (k.endswith("dropout") or k.endswith("pdrop")) and isinstance(v, (int, float)) and v > 0]
    return found


def check_request(model, budget, *, batch_size, seq_len, world_size, device, precision, optimizer,
                  max_grad_norm, hardware, micro_batches, compile_blocks, planning_only=False,
                  host_memory=None, hosts=1, link=None, nonfinite="skip", group_rows=AUTO) -> Request:
    """Every argument checked (TypeError / ValueError naming it) and resolved; allocates nothing.
    `host_memory`: the host RAM the plan may take, per host (None: plan unbounded, compile what is
    available). `hosts`: how many hosts the `world_size` ranks span; `link`: the link between them
    (a costmodel.hardware.LINKS name or bytes/s; required with several hosts)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    budget = Budget.parse(budget)
    batch_size = _positive_int("batch_size", batch_size)
    seq_len = _positive_int("seq_len", seq_len)
    if seq_len < 2:
        raise ValueError("seq_len must be >= 2 (a next-token loss needs two tokens)")
    world_size = _positive_int("world_size", world_size)
    hosts = _positive_int("hosts", hosts)
    if world_size % hosts:
        raise ValueError(f"world_size {world_size} is not a whole number of ranks per host over {hosts} hosts")
    link_bytes_per_s = 0.0
    if hosts > 1:
        if link is None:
            raise ValueError(f"{hosts} hosts: say the link between them, link= one of {', '.join(LINKS)} or a "
                             "rate in bytes/s (each host's rate into the network)")
        link_bytes_per_s = resolve_link(link)
    micro_batches = _positive_int("micro_batches", micro_batches)
    if precision != "auto" and precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {precision!r}")
    check_positions(model, seq_len)
    if optimizer is None:
        optimizer = AdamW()
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"optimizer must be a slidedp.AdamW, got {type(optimizer).__name__}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if nonfinite not in ("skip", "stop"):
        raise ValueError(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")
    group_rows = check_group_rows(group_rows)
    if compile_blocks is not None and not isinstance(compile_blocks, bool):
        raise TypeError(f"compile_blocks must be True, False or None, got {compile_blocks!r}")
    host_memory_bytes = None
    if host_memory is not None:
        try:
            host_memory_bytes = Budget.parse(host_memory).device_bytes
        except (TypeError, ValueError) as e:
            raise type(e)(f"host_memory: {e}") from None
    dev = _resolve_device(device)
    hw = resolve_hardware(hardware, dev.type)
    if precision == "auto":  # bf16 on a GPU, fp32 on the CPU (planning: for a GPU hardware profile, bf16)
        on_gpu = dev.type == "cuda" or (planning_only and hw.name != "cpu")
        precision = "bf16" if on_gpu else "fp32"
    return Request(model=model, budget=budget, batch_size=batch_size, seq_len=seq_len, world_size=world_size,
                   device=dev, precision=precision, optimizer=optimizer, max_grad_norm=max_grad_norm,
                   hardware=hw, micro_batches=micro_batches,
                   compile_blocks=compile_blocks, planning_only=planning_only,
                   host_memory_bytes=host_memory_bytes, hosts=hosts, link_bytes_per_s=link_bytes_per_s,
                   nonfinite=nonfinite, group_rows=group_rows)


def position_limit(config) -> tuple[int | None, str]:
    """(the longest sequence the model's config allows, how it was found), or (None, why not) when
    there is no bound to check: no `max_position_embeddings`, or a RoPE scaling whose reach is
    not a plain product (dynamic NTK scaling)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return None, "no max_position_embeddings"
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        scaling = None
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or rope_type in (None, "default"):
        return limit, f"max_position_embeddings = {limit}"
    factor = scaling.get("factor")
    if rope_type == "dynamic" or isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        return None, f"rope_scaling {rope_type}"
    original = scaling.get("original_max_position_embeddings") or limit
    scaled = max(limit, int(original * factor))
    return scaled, f"{original} positions x rope_scaling {rope_type} factor {factor:g} = {scaled}"


def check_positions(model, seq_len: int) -> None:
    """Refuse a `seq_len` beyond the positions the model's config allows (`max_position_embeddings`,
    scaled by its `rope_scaling` where that is a plain factor), naming both numbers. A model
    without a config (a hand-written one) is not checked."""
    config = getattr(model, "config", None)
    if config is None:
        return
    limit, how = position_limit(config)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} is beyond the {limit} positions the model was made for ({how}); "
                         f"use seq_len <= {limit}, or a model whose config sets rope_scaling for longer "
                         "sequences")


def _given_plan(plan) -> Plan | None:
    if plan is None:
        return None
    the_plan = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    if not isinstance(the_plan, Plan):
        raise TypeError(f"plan must be a slidedp.Plan or a path, got {type(plan).__name__}")
    return the_plan


def _compile_blocks(request: Request) -> bool:
    """Blocks through torch.compile: as asked, else on CUDA (and, when only planning, for any GPU
    hardware profile), not on the CPU."""
    if request.compile_blocks is not None:
        return request.compile_blocks
    return request.device.type == "cuda" or (request.planning_only and request.hardware.name != "cpu")


def _plans_precision(kw: dict, given: Plan | None) -> dict:
    """precision "auto" with a given plan: the plan's."""
    if given is not None and kw.get("precision") == "auto":
        return {**kw, "precision": given.workload.precision}
    return kw


def trace(request: Request, given: Plan | None = None) -> LayerGraph:
    """The layer IR of the model under the request's workload (blocks compiled as `given` says)."""
    tie_meta_model(request.model)
    compiled = given.workload.compiled_blocks if given is not None else _compile_blocks(request)
    return build_layer_graph(request.model, batch_size=request.batch_size, seq_len=request.seq_len,
                             compute_dtype=request.compute_dtype, compiled_blocks=compiled)


def make_plan(request: Request, graph: LayerGraph, given: Plan | None = None,
              solver_options: SolverOptions | None = None) -> Plan:
    """Solve the plan; or check that a `given` plan was made for this model and workload."""
    if given is not None:
        check_plan_matches(given, graph, world_size=request.world_size, precision=request.precision,
                           compiled_blocks=request.compile_blocks, budget_bytes=request.budget.device_bytes,
                           hosts=request.hosts)
        if given.early_order and not given.streamed_gradients and not _early_allowed(request.world_size,
                                                                                     request.max_grad_norm):
            raise ValueError("the plan updates each layer during the backward (early_order), which needs "
                             "max_grad_norm=None and one rank in this process; solve a plan for this run")
        if given.streamed_gradients and not _grads_streamable(request):
            raise ValueError("the plan streams the gradients into the update (streamed_gradients), which needs "
                             "max_grad_norm=None and nonfinite='stop'; solve a plan for this run")
        if given.early_in_place and not _grads_streamable(request):
            raise ValueError("the plan's early updates write in place (early_in_place), which needs "
                             "max_grad_norm=None and nonfinite='stop'; solve a plan for this run")
        streamed, elsewhere = set(given.streamed_updates), set(given.device_state) | set(given.early_order)
        if streamed - set(range(len(graph.layers))) or streamed & elsewhere:
            raise ValueError(f"the plan's streamed_updates {given.streamed_updates} must be layer ids whose state "
                             "lives on the host and that are not updated early (device_state, early_order)")
        budget, host = host_budget(request), given.explanation.peak_host_bytes
        if budget is not None and host > budget:
            raise ValueError(f"the plan takes {format_bytes(host)} ({host} bytes) of host memory (peak_host_bytes), "
                             f"more than host_memory {format_bytes(budget)} ({budget} bytes)")
        return given
    hw, precision = request.hardware, request.precision
    return solve_plan(graph, budget_bytes=request.budget.device_bytes, hardware=hw, world_size=request.world_size,
                      precision=precision, micro_batches=request.micro_batches, version=__version__,
                      compiled_blocks=_compile_blocks(request), options=solver_options,
                      early_host_bytes=1 << 62 if _early_allowed(request.world_size, request.max_grad_norm) else None,
                      grads_streamable=_grads_streamable(request),
                      streamed_updates=hw.gpu_memory_bytes_per_s > 0, host_budget_bytes=host_budget(request),
                      hosts=request.hosts, link_bytes_per_s=request.link_bytes_per_s)


def plan_workload(request: Request, graph: LayerGraph, given: Plan | None = None,
                  solver_options: SolverOptions | None = None) -> tuple[Request, LayerGraph, Plan]:
    """`make_plan` on `graph` (the request's trace); with `request.group_rows`, on the grouping of the
    rank's rows into micro-batches predicted fastest (scheduler/search/micro_rows.py; AUTO: only where
    the asked grouping's blocks are host-bound, else its plan), or the given plan's grouping of as many
    rows. Returns the request, the graph and the plan of that grouping."""
    rows = request.batch_size * request.micro_batches
    if given is not None and request.group_rows and (request.group_rows is True
                                                     or given.workload.batch_size != request.batch_size):
        w = given.workload  # AUTO: only a plan that groups the rows otherwise
        if w.batch_size * w.micro_batches != rows:
            raise ValueError(f"the plan was made for another workload: it groups {w.micro_batches} x {w.batch_size} "
                             f"rows a rank per step, but {request.micro_batches} x {request.batch_size} = {rows} here")
        request = replace(request, batch_size=w.batch_size, micro_batches=w.micro_batches)
    if not request.group_rows or given is not None:
        graph = graph if graph.batch_size == request.batch_size else trace(request, given)
        return request, graph, make_plan(request, graph, given, solver_options)
    graphs, plans = {request.batch_size: graph}, {}
    if request.group_rows == AUTO:
        plans[request.batch_size] = asked = make_plan(request, graph, None, solver_options)
        if (len(groupings(rows)) == 1
                or not blocks_host_bound(graph, request.hardware, asked.workload.compiled_blocks)):
            return request, graph, asked

    def solve(rows_each: int) -> Plan:
        if rows_each in plans:
            return plans[rows_each]
        grouped = replace(request, batch_size=rows_each, micro_batches=rows // rows_each)
        if rows_each not in graphs:
            graphs[rows_each] = trace(grouped)
        return make_plan(grouped, graphs[rows_each], None, solver_options)

    the_plan = fastest_grouping(rows, request.batch_size, solve)
    w = the_plan.workload
    return replace(request, batch_size=w.batch_size, micro_batches=w.micro_batches), graphs[w.batch_size], the_plan


def host_budget(request: Request) -> int | None:
    """The host RAM a plan may take (Explanation.peak_host_bytes, a hard constraint of the solver):
    `host_memory` as given; else, for compile, what this machine has available less the preflight's
    headroom (None: not known, or plan without host_memory: unbounded). On the CPU the ranks' "device"
    buffers are host RAM too: compile's preflight counts them on top."""
    if request.host_memory_bytes is not None or request.planning_only:
        return request.host_memory_bytes
    available = host_available_bytes()
    return None if available is None else max(0, available - HOST_HEADROOM_BYTES)


def lower_plan(graph: LayerGraph, plan: Plan) -> Program:
    """The Program of one pass over the weights, as the plan's schedule decides it."""
    return lower(graph, plan.schedule, micro_batches=plan.workload.micro_batches)


def verify(program: Program, budget: Budget) -> None:
    """Happens-before, buffer lifetimes and peak memory within the budget, before anything is
    allocated (for a solved plan the program needs at most the plan's predicted peak:
    tests/backend/test_program.py). Raises ProgramError naming the op."""
    verify_program(program, budget_bytes=budget.device_bytes)


def _early_allowed(world_size: int, max_grad_norm) -> bool:
    """Early updates (backend/runtime/early_updates.py) need the whole gradient only for its finite check:
    not with clipping, and they run on one rank in the engine's own process."""
    return max_grad_norm is None and in_engine_process(world_size)


def _grads_streamable(request: Request) -> bool:
    """The gradients may stream into the update (backend/runtime/routes.py), and early updates write
    in place: no clipping, and a non-finite gradient stops training (an update applied as its gradient
    lands cannot be taken back); with several ranks the plan streams them only where it reduces every
    host layer on the GPUs."""
    return request.max_grad_norm is None and request.nonfinite == "stop"


def check_plan_matches(plan: Plan, graph: LayerGraph, *, world_size: int, precision: str,
                       compiled_blocks: bool | None = None, budget_bytes: int | None = None,
                       hosts: int | None = None) -> None:
    """Refuse a plan made for another model, workload or world size, or whose fields do not hold
    together or do not fit this model, naming the field (`compiled_blocks` None: whatever the plan
    says; `budget_bytes`: the run's budget, which the plan's peak must fit)."""
    w = plan.workload
    for name, planned, actual in (  # the workload first: the fingerprint depends on it
        ("batch_size", w.batch_size, graph.batch_size),
        ("seq_len", w.seq_len, graph.seq_len),
        ("world_size", w.world_size, world_size),
        ("hosts", w.hosts, w.hosts if hosts is None else hosts),
        ("precision", w.precision, precision),
        ("compile_blocks", w.compiled_blocks, w.compiled_blocks if compiled_blocks is None else compiled_blocks),
        ("model fingerprint", plan.model_fingerprint, graph.fingerprint()),
    ):
        if planned != actual:
            raise ValueError(f"the plan was made for another workload: {name} is {planned!r} in the plan "
                             f"but {actual!r} here")
    plan.validate(world_size)
    if len(plan.decisions) != len(graph.layers):
        raise ValueError(f"the plan is not valid: decisions: {len(plan.decisions)} layer decisions, but this model "
                         f"has {len(graph.layers)} layers")
    for i, (d, layer) in enumerate(zip(plan.decisions, graph.layers)):
        for name, planned, actual in (("layer_id", d.layer_id, layer.id), ("name", d.name, layer.name),
                                      ("kind", d.kind, layer.kind), ("numel", d.numel, layer.numel)):
            if planned != actual:
                raise ValueError(f"the plan is not valid: decisions[{i}].{name} is {planned!r} in the plan but "
                                 f"{actual!r} in this model")
    peak = plan.explanation.peak_device_bytes
    if budget_bytes is not None and peak > budget_bytes:
        raise ValueError(f"the plan is not valid: peak_device_bytes: the plan's peak {peak} bytes exceeds the "
                         f"budget of {budget_bytes} bytes")


def plan(model: nn.Module, budget, *, batch_size: int | None = None, seq_len: int | None = None,
         world_size: int = 1, device: str = "auto", precision: str = "auto", optimizer: AdamW | None = None,
         max_grad_norm: float | None = None, hardware=None, plan=None, micro_batches: int = 1,
         compile_blocks: bool | None = None, solver_options: SolverOptions | None = None,
         host_memory: int | str | None = None, options: CompileOptions | None = None, hosts: int = 1,
         link=None, nonfinite: str = "skip", group_rows: bool | str = AUTO) -> Plan:
    """Solve a schedule without allocating anything (works on a meta-device model).
    `options`: a CompileOptions in place of the workload's keyword arguments (batch_size .. compile_blocks).
    `compile_blocks` (see `compile`) None: yes for a GPU hardware profile, no for the CPU.
    `precision` "auto" (default): bf16 for a GPU hardware profile (or the GPU here), fp32 for the CPU.
    `host_memory` (bytes or e.g. "125GiB"): the host RAM the plan may take on the machine it is for,
    a hard constraint like the budget: everything host-side (`Explanation.host_memory`: the host
    state as laid out, early updates' spare state, offloaded activations, pinned buffers) within it;
    more optimizer state on the device where that is what fits (one rank); InfeasibleBudgetError
    with `min_host_bytes` below the least any plan takes (None: unbounded; compile's preflight checks
    there).
    `hosts`: the hosts the `world_size` ranks span (world_size / hosts each, as `torchrun --nnodes
    hosts` runs them), with `link` between them (a LINKS preset of slidedp.costmodel.hardware, e.g.
    "ib-4x400", or bytes/s): each host's ranks share its links, DRAM and cores, collectives between
    hosts cross the link, every host layer is delivered sharded and reduced on the GPUs, and
    `host_memory` and the plan's host figures are per host.
    `solver_options` (slidedp.SolverOptions): the values the solver may choose
    from, e.g. `SolverOptions(deliveries=("sharded",), reductions=("gpu",))` forces those routes
    (several ranks and GPU peer-to-peer needed, else ValueError); pass the plan to `compile(plan=)`.
    `group_rows` (see `compile`): the rows of a rank's step grouped as predicted fastest."""
    kw = merge(options, dict(batch_size=batch_size, seq_len=seq_len, world_size=world_size, device=device,
                             precision=precision, optimizer=optimizer, max_grad_norm=max_grad_norm,
                             hardware=hardware, micro_batches=micro_batches, compile_blocks=compile_blocks,
                             nonfinite=nonfinite, group_rows=group_rows))
    if kw["device"] == "auto":
        kw["device"] = "cpu" if kw["hardware"] is None and not torch.cuda.is_available() else "auto"
    if solver_options is not None:
        if not isinstance(solver_options, SolverOptions):
            raise TypeError(f"solver_options must be a SolverOptions, got {type(solver_options).__name__}")
        if plan is not None:
            raise ValueError("solver_options and plan exclude each other: a given plan is not solved again")
    given = _given_plan(plan)
    request = check_request(model, budget, **_plans_precision(kw, given), planning_only=True,
                            host_memory=host_memory, hosts=hosts, link=link)
    return plan_workload(request, trace(request, given), given, solver_options)[2]


def predict(model: nn.Module, plan, *, hardware=None) -> float:
    """The step time [s] the cost model predicts for a saved plan's decisions on `model`, under
    `hardware` (a preset name, a `slidedp calibrate` profile path or a Hardware; None: the hardware
    the plan was solved for, which gives the plan's own prediction). Nothing is solved or allocated
    (a meta-device model will do); the model must be the plan's (its fingerprint)."""
    the_plan = _given_plan(plan)
    if the_plan is None:
        raise TypeError("predict needs a plan (a slidedp.Plan or a path)")
    hw = None if hardware is None else resolve_hardware(hardware, "cpu")
    return replay(the_plan, plan_graph(model, the_plan), hw).step_s


def plan_graph(model: nn.Module, plan: Plan) -> LayerGraph:
    """`model` traced into the layer IR at the plan's workload (a meta-device model will do)."""
    w = plan.workload
    tie_meta_model(model)
    return build_layer_graph(model, batch_size=w.batch_size, seq_len=w.seq_len,
                             compute_dtype=COMPUTE_DTYPES[w.precision], compiled_blocks=w.compiled_blocks)


def compile(model: nn.Module, budget, *, batch_size: int | None = None, seq_len: int | None = None,
            world_size: int = 1, device: str = "auto", precision: str = "auto", optimizer: AdamW | None = None,
            max_grad_norm: float | None = None, hardware=None, plan=None, micro_batches: int = 1,
            compile_blocks: bool | None = None, weights=None, options: CompileOptions | None = None,
            host_memory: int | str | None = None, link=None, nonfinite: str = "skip",
            group_rows: bool | str = AUTO) -> Engine:
    """Trace, plan, and allocate: returns an Engine whose `step()` trains the model.

    `options`: a CompileOptions in place of the workload's keyword arguments (batch_size ..
    compile_blocks), e.g. `compile(model, "24GiB", options=CompileOptions(batch_size=4, seq_len=2048))`.

    `weights`: where the initial weights come from (slidedp/run/weights.py): None, the model's own
    parameters; a safetensors checkpoint folder or a function fn(name, out) filling each fp32
    master, for a model built with its parameters on the meta device
    (`accelerate.init_empty_weights()`), read straight into the host state.

    `host_memory` (bytes or e.g. "100GiB"): the host RAM the plan may take (see `plan`); None
    (default): what this machine has available (MemAvailable, or the cgroup's limit) less the
    preflight's headroom. The preflight then checks the plan's `peak_host_bytes` against what is
    available.

    `micro_batches` is how many micro-batches per rank share one pass over the weights (more rows
    than that in `step()` run as several passes, gradients summed on the host).

    `group_rows`: the plan may group a rank's batch_size x micro_batches rows of a step into
    micro-batches of another number of rows (a divisor, at most 8), each grouping solved and the
    fastest predicted kept (scheduler/search/micro_rows.py; the plan's workload says which, and its
    summary that a sweep chose it). The step is the same sum of gradients (to rounding); `step()`
    then takes a multiple of the plan's batch_size x world_size rows. "auto" (default): so only where
    the cost model finds the asked grouping's blocks host-bound (the host's issue of a block outlasts
    its kernels, as `slidedp calibrate` measures it), else the asked grouping's plan, one solve; False:
    the asked grouping.

    `precision`: "auto" (default) bf16 on a GPU, fp32 on the CPU (with a given plan: the plan's);
    "bf16" or "fp32".

    `compile_blocks`: run every block through `torch.compile` (backend/runtime/executor.py), and plan
    with the hardware's compiled block rate; None (default): as a given plan says, else on CUDA
    devices but not on the CPU, where compiling costs more than it saves.

    With `world_size` > 1 the ranks are worker processes (one per GPU, or CPU processes), started
    here and driven by this process: `step()` takes the global batch (backend/runtime/workers.py). Under
    `torchrun --nproc-per-node=W` (WORLD_SIZE=W in the environment) every process is one rank
    instead: each calls `compile` and `step` with the same arguments and global batch, and
    takes its share of the rows; rank 0's process holds the host state, the others map it. Under
    `torchrun --nnodes N --nproc-per-node G` (W = N * G) each host's first rank holds that host's
    state; the plan delivers every host layer sharded and reduces it on the GPUs (solved so, or a
    given plan refused otherwise), so that each host updates the chunks its ranks own; `link` (see
    `plan`) says what joins the hosts (a given plan's own link when omitted).
    """
    kw = merge(options, dict(batch_size=batch_size, seq_len=seq_len, world_size=world_size, device=device,
                             precision=precision, optimizer=optimizer, max_grad_norm=max_grad_norm,
                             hardware=hardware, micro_batches=micro_batches, compile_blocks=compile_blocks,
                             nonfinite=nonfinite, group_rows=group_rows))
    given = _given_plan(plan)
    hosts = launched_hosts(kw["world_size"]) if isinstance(kw["world_size"], int) else 1
    if hosts > 1 and link is None and given is not None:
        link = given.workload.link_bytes_per_s or None
    request = check_request(model, budget, **_plans_precision(kw, given), host_memory=host_memory, hosts=hosts,
                            link=link)
    rank = launched_rank(request.world_size)
    dropout = dropout_settings(model)
    if dropout and not rank:  # one warning, from the process that holds the host state
        log.warning("slidedp: training without dropout (%s): every block runs in eval mode, so that a recomputed "
                    "forward is the forward it replaces", ", ".join(dropout))
    with timed("traced"):
        graph = trace(request, given)
    check_weights_source(request.model, graph, weights)  # before solving: a model without weights is refused at once
    # several hosts: each rank reads from its host's state only what its host updates (run/launch.py)
    routes = SolverOptions(deliveries=("sharded",), reductions=("gpu",)) if hosts > 1 and given is None else None
    with timed("planned" if given is None else "plan checked"):
        request, graph, the_plan = plan_workload(request, graph, given, routes)
    check_hosts_routes(the_plan, hosts)
    comm = rank_device = None
    if rank is not None:
        comm, rank_device = connect(request, rank)
        the_plan = from_rank0(comm, the_plan)  # one plan for all, whatever each process solved
        w = the_plan.workload
        if w.batch_size != graph.batch_size:  # rank 0 grouped the rows otherwise (group_rows)
            request = replace(request, batch_size=w.batch_size, micro_batches=w.micro_batches)
            graph = trace(request, the_plan)
    with timed("lowered"):
        program = lower_plan(graph, the_plan)
        verify(program, request.budget)
    return launch(request, graph, the_plan, program, weights=weights, rank=rank, comm=comm, device=rank_device)
