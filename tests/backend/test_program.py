"""Lowering a plan to a Program, and the simulator that checks it (and catches broken programs)."""

import dataclasses
import itertools

import networkx as nx
import pytest
import torch

import slidedp
from slidedp.api import lower_plan
from slidedp.costmodel.hardware import PRESETS
from slidedp.scheduler.decisions import (
    FORWARD_ORDER, KEEP, OFFLOAD, RECOMPUTE, RESIDENT, Decisions, LayerChoice, SolverOptions,
)
from slidedp.scheduler.plan import LayerDecision, Schedule
from slidedp.scheduler.problem.lanes import window_loads
from slidedp.scheduler.solve import fixed_plan

from slidedp.backend.lowering.graph import dependency_graph
from slidedp.backend.lowering.program import BWD, D2H_GRAD, EPILOGUE, FREE, FWD, H2D_WEIGHTS, PROLOGUE_BWD, lower
from slidedp.backend.lowering.verify import ProgramError, verify_program
from slidedp.ir.build import build_layer_graph
from tests.models import make_model


@pytest.fixture(scope="module")
def graph():
    model = make_model("llama")
    return build_layer_graph(model, batch_size=2, seq_len=16, compute_dtype=torch.float32)


def lowered(graph, window=2, policies=("recompute", "keep", "offload"), chunks=2):
    policy = {b.id: p for b, p in zip(graph.blocks, policies)}
    decisions = tuple(LayerDecision(layer.id, layer.name, layer.kind, layer.numel, chunks,
                                    policy.get(layer.id, "resident")) for layer in graph.layers)
    return lower(graph, Schedule(window, decisions, window_loads(len(graph.blocks), window)), micro_batches=2)


@pytest.mark.parametrize("window", [1, 2, 3, 4])
@pytest.mark.parametrize("policies", [("recompute",) * 3, ("keep",) * 3, ("offload", "keep", "recompute")])
def test_lowered_programs_are_valid(graph, window, policies):
    program = lowered(graph, window, policies)
    report = verify_program(program)
    n = len(graph.blocks)
    assert report.n_loads == 2 * n - min(window, n)
    assert [op.block for op in program.ops if op.kind == FWD] == list(range(n))
    assert [op.block for op in program.ops if op.kind == BWD] == list(range(n - 1, -1, -1))
    assert sum(op.kind == D2H_GRAD for op in program.ops) == len(graph.layers)
    assert "h2d_weights" in program.text()
    deps = dependency_graph(program)
    assert nx.is_directed_acyclic_graph(deps)
    assert sum(why != "stream" for _, _, why in deps.edges(data="why")) == report.n_waits
    assert all(deps.nodes[op.index]["stream"] == op.stream for op in program.ops)


def test_the_dependency_graph_orders_streams_and_events(graph):
    """Each op follows the previous op of its stream, and each waiter its event's recorder."""
    program = lowered(graph, window=1)
    deps = dependency_graph(program)
    load = next(op for op in program.ops if op.kind == H2D_WEIGHTS)
    fwd = next(op for op in program.ops if op.kind == FWD)
    assert deps.edges[load.index, fwd.index]["why"] == f"event {load.record}"
    computes = [op.index for op in program.ops if op.stream == "compute"]
    assert all(deps.edges[a, b]["why"] == "stream" for a, b in zip(computes, computes[1:]))
    assert not deps.has_edge(computes[0], computes[2])


def test_simulator_refuses_a_cycle_of_waits_across_streams(graph):
    """The first load waits for the epilogue, which (through the compute stream) waits for the
    forwards, which wait for the loads after that one: a deadlock on a GPU, refused with the ops on
    a cycle (each cycle passes the broken wait)."""
    program = lowered(graph, window=1)
    load = next(op for op in program.ops if op.kind == H2D_WEIGHTS)
    head = next(op for op in program.ops if op.kind == EPILOGUE)
    broken = _without(program, lambda op: op.index == load.index,
                      lambda op: dataclasses.replace(op, waits=(head.record,)))
    with pytest.raises(ProgramError, match="deadlock") as info:
        verify_program(broken)
    message = str(info.value)
    for op in (load, head):
        assert f"op {op.index} ({op.kind} on {op.stream})" in message
    assert f"(epilogue on compute) -> op {load.index} (h2d_weights on h2d)" in message
    assert "(fwd on compute)" in message


def test_simulator_refuses_an_event_recorded_twice(graph):
    program = lowered(graph)
    fwd = next(op for op in program.ops if op.kind == FWD)
    free = next(op for op in program.ops if op.kind == FREE)
    broken = _without(program, lambda op: op.index == free.index, lambda op: dataclasses.replace(op, record=fwd.record))
    with pytest.raises(ProgramError, match=f"event {fwd.record} is recorded by ops"):
        verify_program(broken)


def test_the_epilogues_gradient_leaves_before_the_blocks_backward(graph):
    """The epilogue's own gradient is whole after its op (a tied head's part belongs to the prologue),
    so its copy waits for that op only, and drains while the blocks' backward runs; the prologue's
    waits for the prologue's backward. Making it wait for nothing is caught."""
    program = lowered(graph)
    ops = program.ops
    head = next(op for op in ops if op.kind == EPILOGUE)
    copies = {op.layer_id: op for op in ops if op.kind == D2H_GRAD}
    first_bwd = next(op for op in ops if op.kind == BWD)
    assert copies[graph.epilogue.id].waits == (head.record,) and copies[graph.epilogue.id].index < first_bwd.index
    prologue_bwd = next(op for op in ops if op.kind == PROLOGUE_BWD)
    assert copies[graph.prologue.id].waits == (prologue_bwd.record,)
    early = _without(program, lambda op: op.index == copies[graph.epilogue.id].index,
                     lambda op: dataclasses.replace(op, waits=()))
    with pytest.raises(ProgramError, match="gradient before it is computed"):
        verify_program(early)


def test_more_kept_activations_need_more_memory(graph):
    recompute = verify_program(lowered(graph, policies=("recompute",) * 3)).peak_device_bytes
    keep = verify_program(lowered(graph, policies=("keep",) * 3)).peak_device_bytes
    assert keep > recompute
    with pytest.raises(ProgramError, match="over the budget"):
        verify_program(lowered(graph, policies=("keep",) * 3), budget_bytes=recompute)


def _without(program, predicate, replace):
    ops = tuple(replace(op) if predicate(op) else op for op in program.ops)
    return dataclasses.replace(program, ops=ops)


def test_simulator_catches_a_missing_wait_for_the_load(graph):
    program = lowered(graph, window=1)
    first_fwd = next(op for op in program.ops if op.kind == FWD)
    broken = _without(program, lambda op: op.index == first_fwd.index, lambda op: dataclasses.replace(op, waits=()))
    with pytest.raises(ProgramError, match="before its load"):
        verify_program(broken)


def test_simulator_catches_a_load_that_overwrites_a_slot_in_use(graph):
    program = lowered(graph, window=1)
    second_load = [op for op in program.ops if op.kind == H2D_WEIGHTS][1]
    broken = _without(program, lambda op: op.index == second_load.index, lambda op: dataclasses.replace(op, waits=()))
    with pytest.raises(ProgramError, match="finished reading"):
        verify_program(broken)


def test_simulator_catches_an_early_gradient_copy_and_leaks(graph):
    program = lowered(graph)
    d2h = next(op for op in program.ops if op.kind == D2H_GRAD)
    broken = _without(program, lambda op: op.index == d2h.index, lambda op: dataclasses.replace(op, waits=()))
    with pytest.raises(ProgramError, match="gradient before it is computed"):
        verify_program(broken)
    leak = dataclasses.replace(program, ops=tuple(op for op in program.ops if not (op.kind == FREE and op.buffer == "grad_hidden")))
    with pytest.raises(ProgramError, match="still allocated"):
        verify_program(leak)
    bad_event = _without(program, lambda op: op.index == d2h.index, lambda op: dataclasses.replace(op, waits=(10**6,)))
    with pytest.raises(ProgramError, match="not recorded by any op"):
        verify_program(bad_event)


@pytest.mark.parametrize("family, precision, micro_batches", [
    ("llama", "fp32", 1), ("qwen3", "bf16", 2), ("gpt2", "bf16", 3), ("mistral", "fp32", 2),
])
def test_lowered_plan_fits_the_plans_predicted_peak(family, precision, micro_batches):
    """The backend's buffers and the solver's footprint come from the same memory functions: for
    solved plans (smallest feasible budget, roomy budget) and for fixed mixes of keep / offload /
    recompute, chunks and windows, the lowered program never needs more device memory than the
    plan predicts."""
    model = make_model(family)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    # a GPU profile plans compiled blocks, whose kept activations are counted as the compiled graph saves them
    graph = build_layer_graph(model, batch_size=2, seq_len=16, compute_dtype=dtype, compiled_blocks=True)
    kwargs = dict(batch_size=2, seq_len=16, precision=precision, device="cpu", hardware="h100-sxm",
                  micro_batches=micro_batches)
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        slidedp.plan(model, 1024, **kwargs)
    plans = [slidedp.plan(model, budget, **kwargs) for budget in (info.value.min_budget_bytes, 2**30)]
    assert all(p.workload.compiled_blocks for p in plans)
    options = SolverOptions(chunk_multiples=(1, 3))
    for window, chunks, mix in itertools.product((1, 3), (1, 3), itertools.permutations((KEEP, OFFLOAD, RECOMPUTE))):
        def decide(costs, budget, window=window, chunks=chunks, mix=mix):
            return Decisions(window, FORWARD_ORDER, tuple(
                LayerChoice(chunks, mix[(i - 1) % 3] if i in costs.blocks else RESIDENT) for i in range(costs.n_layers)))
        plans.append(fixed_plan(graph, decide, method="mix", budget_bytes=2**40, hardware=PRESETS["h100-sxm"],
                                world_size=1, precision=precision, micro_batches=micro_batches, options=options,
                                compiled_blocks=True))
    for plan in plans:
        assert verify_program(lower_plan(graph, plan)).peak_device_bytes <= plan.peak_device_bytes


def test_offloaded_block_inputs_fit_the_plans_predicted_peak():
    """recompute_offload: the lowered program frees a block's input between its copy down and its copy
    back (where no other graph holds it, plan.input_offloaded; never the last block's), its backward
    waits for the copy back, and it never needs more device memory than the plan predicts; offload: the
    same for its saved activations."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slidedp.backend.lowering.program import D2H_INPUT, D2H_SAVED, H2D_INPUT, H2D_SAVED
    from slidedp.scheduler.decisions import RECOMPUTE_OFFLOAD as RO
    from slidedp.scheduler.plan import input_offloaded
    from tests.models import _common

    torch.manual_seed(0)
    graph = build_layer_graph(LlamaForCausalLM(LlamaConfig(**{**_common(False), "num_hidden_layers": 6})),
                              batch_size=2, seq_len=16, compute_dtype=torch.float32)
    mixes = [(RO,) * 6, (RECOMPUTE, RO, KEEP, RO, RO, OFFLOAD), (KEEP, RO, RECOMPUTE, RO, RECOMPUTE, RO),
             (OFFLOAD, RECOMPUTE, RO, OFFLOAD, KEEP, OFFLOAD)]
    for window, mix in itertools.product((1, 2), mixes):
        def decide(costs, budget, window=window, mix=mix):
            return Decisions(window, FORWARD_ORDER, tuple(
                LayerChoice(1, mix[i - 1] if i in costs.blocks else RESIDENT) for i in range(costs.n_layers)))
        plan = fixed_plan(graph, decide, method="mix", budget_bytes=2**40, hardware=PRESETS["h100-sxm"],
                          world_size=1, precision="fp32", micro_batches=2)
        program = lower_plan(graph, plan)
        assert verify_program(program).peak_device_bytes <= plan.peak_device_bytes
        activation = plan.activation_policy()
        expected = {k for k, b in enumerate(graph.blocks[:-1]) if input_offloaded(activation, b.id)}
        assert expected and {op.block for op in program.ops if op.kind == D2H_INPUT} == expected
        ups = {op.block: op.record for op in program.ops if op.kind == H2D_INPUT}
        assert set(ups) == expected
        assert all(ups[op.block] in op.waits for op in program.ops if op.kind == BWD and op.block in expected)
        # offload: the saved activations come back on the H2D stream, the backward waiting for them
        saved = {k for k, b in enumerate(graph.blocks) if activation[b.id] == OFFLOAD}
        assert {op.block for op in program.ops if op.kind == D2H_SAVED} == saved
        backs = {op.block: op.record for op in program.ops if op.kind == H2D_SAVED and op.stream == "h2d"}
        assert set(backs) == saved
        assert all(backs[op.block] in op.waits for op in program.ops if op.kind == BWD and op.block in saved)


@pytest.mark.parametrize("window", [1, 3])
def test_a_blocks_backward_waits_for_the_gradient_buffer_it_replaces(graph, window):
    """The plan charges two block gradient buffers (one filling, one draining): from the third block of
    the backward on, each backward waits for the copy of the gradient two blocks earlier; without that
    wait the simulator refuses the program."""
    program = lowered(graph, window)
    ops = program.ops
    bwds = [op for op in ops if op.kind == BWD]
    copies = {op.layer_id: op for op in ops if op.kind == D2H_GRAD}
    drains = [copies[op.layer_id].record for op in bwds]
    assert len(bwds) >= 3
    for i, op in enumerate(bwds):
        assert (drains[i - 2] in op.waits) == (i >= 2)
    third = bwds[2]
    broken = _without(program, lambda op: op.index == third.index,
                      lambda op: dataclasses.replace(op, waits=tuple(e for e in op.waits if e != drains[0])))
    with pytest.raises(ProgramError, match=f"op {third.index} .*before op {copies[bwds[0].layer_id].index} has drained"):
        verify_program(broken)

