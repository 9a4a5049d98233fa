"""Forcing a route through SolverOptions: leaving out the replicated delivery or the CPU reduction
plans only the others (benchmarks/multi_gpu_scaling/run.py measures each combination), and is refused
where only (replicated, cpu) exists: one rank, or GPUs without peer-to-peer."""

import pytest

import slidedp
from slidedp.costmodel.hardware import PRESETS
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.solve import solve_plan
from tests.models import make_model
from tests.scheduler.graphs import synthetic_graph

GiB = 2**30
ROUTES = [("replicated", "cpu"), ("replicated", "gpu"), ("sharded", "cpu"), ("sharded", "gpu")]
# a small search: one window, one chunk multiple, no optimizer state on the device (every layer streamed)
QUICK = dict(windows=(2,), chunk_multiples=(1,), activations=("recompute",), update_orders=("forward",),
             device_state_blocks=0)


@pytest.mark.parametrize("route", ROUTES, ids=["-".join(r) for r in ROUTES])
def test_a_forced_route_is_the_only_one_planned(route):
    delivery, reduction = route
    plan = solve_plan(synthetic_graph(2), budget_bytes=12 * GiB, hardware=PRESETS["h100-sxm"], world_size=2,
                      options=SolverOptions(deliveries=(delivery,), reductions=(reduction,), **QUICK))
    assert {(d.delivery, d.reduction) for d in plan.decisions} == {route}
    assert plan.predicted_step_time_s > 0 and plan.peak_device_bytes <= 12 * GiB
    if route != ("replicated", "cpu"):
        assert any("routes forced" in note for note in plan.notes)


def test_forcing_one_side_leaves_the_other_to_the_solver():
    plan = solve_plan(synthetic_graph(2), budget_bytes=12 * GiB, hardware=PRESETS["h100-sxm"], world_size=2,
                      options=SolverOptions(reductions=("gpu",), **QUICK))
    assert {d.reduction for d in plan.decisions} == {"gpu"}
    assert {d.delivery for d in plan.decisions} <= {"replicated", "sharded"}


@pytest.mark.parametrize("forced", [dict(deliveries=("sharded",)), dict(reductions=("gpu",))])
def test_a_route_that_cannot_be_planned_is_refused(forced):
    with pytest.raises(ValueError, match="leave out the replicated delivery or the CPU reduction.*world_size is 1"):
        solve_plan(synthetic_graph(2), budget_bytes=12 * GiB, hardware=PRESETS["h100-sxm"], world_size=1,
                   options=SolverOptions(**forced, **QUICK))


def test_without_peer_to_peer_a_forced_route_goes_through_host_memory():
    """GPUs without peer-to-peer: the sharded delivery and the GPU reduction are planned only where the
    options force them, their collectives priced through host memory."""
    graph, hw = synthetic_graph(2), PRESETS["rtx4090"]
    free = solve_plan(graph, budget_bytes=12 * GiB, hardware=hw, world_size=2, options=SolverOptions(**QUICK))
    assert {(d.delivery, d.reduction) for d in free.decisions} == {("replicated", "cpu")}
    forced = solve_plan(graph, budget_bytes=12 * GiB, hardware=hw, world_size=2,
                        options=SolverOptions(deliveries=("sharded",), reductions=("gpu",), **QUICK))
    assert {(d.delivery, d.reduction) for d in forced.decisions} == {("sharded", "gpu")}
    assert forced.predicted_step_time_s > 0
    assert any("through host memory" in note for note in forced.notes) and not forced.problems()


def test_route_values_are_checked():
    for bad in (dict(deliveries=()), dict(deliveries=("broadcast",)), dict(reductions=("cpu", "host"))):
        with pytest.raises(ValueError, match="must be among"):
            SolverOptions(**bad)
    assert not SolverOptions().forces_route and SolverOptions(deliveries=("sharded",)).forces_route


def test_slidedp_plan_takes_solver_options():
    model = make_model("llama")
    kwargs = dict(batch_size=2, seq_len=16, precision="fp32", device="cpu", world_size=2, hardware="h100-sxm",
                  compile_blocks=False)
    forced = SolverOptions(deliveries=("sharded",), reductions=("gpu",), **QUICK)
    plan = slidedp.plan(model, "1GiB", solver_options=forced, **kwargs)
    assert {(d.delivery, d.reduction) for d in plan.decisions} == {("sharded", "gpu")}
    with pytest.raises(ValueError, match="exclude each other"):
        slidedp.plan(model, "1GiB", solver_options=forced, plan=plan, **kwargs)
    with pytest.raises(TypeError, match="SolverOptions"):
        slidedp.plan(model, "1GiB", solver_options={"deliveries": ("sharded",)}, **kwargs)
    with pytest.raises(ValueError, match="world_size is 1"):
        slidedp.plan(model, "1GiB", solver_options=forced, **{**kwargs, "world_size": 1})
