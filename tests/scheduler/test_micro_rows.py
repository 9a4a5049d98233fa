"""Rows per micro-batch (`group_rows`): a sweep of full solves, checked against solving each grouping
alone (brute force), and the grouped plan's training against torch.optim.AdamW."""

import copy
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import slidedp
from slidedp.costmodel.hardware import resolve_hardware
from slidedp.errors import InfeasibleBudgetError
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.search.micro_rows import SEARCH, check_group_rows, groupings
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side
from tests.models import make_model

SHORT = SolverOptions(deterministic_time=0.1)
# compiled blocks whose host issue outlasts a small block's kernels (about the H100's calibrated floor):
# more rows per micro-batch make fewer issues
HOST_BOUND = replace(resolve_hardware("h100-sxm", "cuda"), compiled_block_efficiency=0.5,
                     host_compiled_fwd_s=1.2e-3, host_compiled_bwd_s=2.2e-3)


def _narrow():
    cfg = Qwen3Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


def test_groupings_are_the_divisors_up_to_the_cap():
    assert groupings(16) == (1, 2, 4, 8)
    assert groupings(6) == (1, 2, 3, 6)
    assert groupings(12, max_rows=4) == (1, 2, 3, 4)
    assert groupings(1) == (1,)
    with pytest.raises(ValueError, match="rows_per_step"):
        groupings(0)


@pytest.mark.parametrize("asked", [1, 4])
def test_the_sweep_keeps_the_fastest_grouping_each_solved_alone(asked):
    kwargs = dict(seq_len=1024, hardware=HOST_BOUND, solver_options=SHORT)
    plan = slidedp.plan(_narrow(), "3GiB", batch_size=asked, micro_batches=4 // asked, group_rows=True, **kwargs)
    tried = {int(rows): step_s for rows, step_s in plan.solver["rows_tried"].items()}
    assert set(tried) == {1, 2, 4}
    alone = {rows: slidedp.plan(_narrow(), "3GiB", batch_size=rows, micro_batches=4 // rows, group_rows=False,
                                **kwargs).predicted_step_time_s for rows in tried}
    assert tried == pytest.approx(alone, rel=1e-9)
    best = min(alone, key=lambda rows: (alone[rows], rows != asked, rows))
    assert best > 1, alone  # host-bound: the sweep has a grouping to gain from
    w = plan.workload
    assert (w.batch_size, w.micro_batches) == (best, 4 // best)
    assert plan.predicted_step_time_s == pytest.approx(alone[best], rel=1e-9)
    assert plan.solver["chosen_by"].endswith(f"{SEARCH} swept") and plan.solver["rows_sweep_wall_s"] > 0
    assert f"decided by: {SEARCH}: sweep" in plan.summary()
    alternative = next(a for a in plan.alternatives if a.decision == SEARCH)
    assert alternative.chosen == f"{best} row(s)" and alternative.runner_up_step_s >= alternative.chosen_step_s


def test_groupings_that_do_not_fit_are_passed_over_and_none_fitting_is_refused():
    kwargs = dict(seq_len=4096, hardware=HOST_BOUND, solver_options=SHORT, batch_size=1, micro_batches=8)
    with pytest.raises(InfeasibleBudgetError) as alone:
        slidedp.plan(_narrow(), "600MiB", **{**kwargs, "batch_size": 8, "micro_batches": 1})
    floor_8_rows = alone.value.min_budget_bytes
    plan = slidedp.plan(_narrow(), floor_8_rows - 1, group_rows=True, **kwargs)  # below the 8-row floor
    assert 8 in plan.solver["rows_unfit"] and plan.workload.batch_size < 8 and "1" in plan.solver["rows_tried"]
    assert plan.predicted_step_time_s == min(plan.solver["rows_tried"].values())
    with pytest.raises(InfeasibleBudgetError):  # nothing fits: the asked grouping's error
        slidedp.plan(_narrow(), "64MiB", group_rows=True, **kwargs)


def test_auto_sweeps_only_where_the_blocks_are_host_bound():
    """group_rows="auto" (the default): on host-bound blocks the sweep runs as with True; where the
    hardware has no host floor (the h100-sxm preset) the asked grouping's plan is kept, one solve, as
    with False."""
    kwargs = dict(seq_len=1024, batch_size=1, micro_batches=4, solver_options=SHORT)
    swept = slidedp.plan(_narrow(), "3GiB", hardware=HOST_BOUND, **kwargs)
    assert set(swept.solver["rows_tried"]) == {"1", "2", "4"} and swept.workload.batch_size > 1
    assert swept.solver["gap_explained"].endswith(f"(among plans of {swept.workload.batch_size}-row micro-batches; "
                                                  "the groupings swept)")
    plain = resolve_hardware("h100-sxm", "cuda")
    kept, asked = (slidedp.plan(_narrow(), "3GiB", hardware=plain, group_rows=g, **kwargs) for g in ("auto", False))
    assert "rows_tried" not in kept.solver and (kept.workload.batch_size, kept.workload.micro_batches) == (1, 4)
    assert kept.predicted_step_time_s == asked.predicted_step_time_s
    assert check_group_rows("auto") == "auto" and check_group_rows(False) is False
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="group_rows must be"):
            slidedp.plan(_narrow(), "3GiB", hardware=plain, group_rows=bad, **kwargs)


def test_a_grouped_plan_trains_as_torch_adamw():
    """A plan of 2-row micro-batches, given to a compile asked for 4 one-row ones with group_rows: the
    engine takes the plan's grouping, and its steps match torch.optim.AdamW on the whole batch."""
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    run = dict(seq_len=SEQ, device="cpu", precision="fp32", max_grad_norm=CLIP)
    grouped = slidedp.plan(model, "1GiB", batch_size=BATCH, micro_batches=2, **run)
    with pytest.raises(ValueError, match="batch_size"):  # without group_rows the plan's rows must be the asked ones
        slidedp.compile(model, "1GiB", batch_size=1, micro_batches=2 * BATCH, plan=grouped, group_rows=False, **run)
    with pytest.raises(ValueError, match="rows a rank per step"):  # with it, as many rows a step
        slidedp.compile(model, "1GiB", batch_size=1, micro_batches=BATCH, plan=grouped, group_rows=True, **run)
    engine = slidedp.compile(model, "1GiB", batch_size=1, micro_batches=2 * BATCH, plan=grouped, group_rows=True,
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), **run)
    with engine:
        assert (engine.plan.workload.batch_size, engine.graph.batch_size) == (BATCH, BATCH)
        train_side_by_side(engine, ref, steps=3, seed=4)


def test_compile_with_group_rows_trains_as_torch_adamw():
    model = make_model("qwen3")
    ref = copy.deepcopy(model).eval()
    engine = slidedp.compile(model, "1GiB", batch_size=1, micro_batches=2 * BATCH, seq_len=SEQ, device="cpu",
                             precision="fp32", max_grad_norm=CLIP, group_rows=True,
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD))
    with engine:
        w = engine.plan.workload
        assert w.batch_size * w.micro_batches == 2 * BATCH and engine.graph.batch_size == w.batch_size
        assert set(engine.plan.solver["rows_tried"]) == {"1", "2", "4"}
        train_side_by_side(engine, ref, steps=3, seed=5)
