"""Delivery copies made on load: a layer whose plan says `host_copy="on_load"` keeps no bf16 copy in
host RAM, its loads read the fp32 master and cast it; training is bit for bit the same as with every
copy kept (the cast is the optimizer's rounding), with clipping and accumulation, and checkpoints move
between the two layouts."""

import copy
from dataclasses import replace

import pytest
import torch

import slidedp
from slidedp.costmodel import memory as mem
from slidedp.scheduler.decisions import SolverOptions
from tests.engine.test_exactness import BATCH, SEQ, random_batch
from tests.models import make_model

KW = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="bf16", max_grad_norm=0.5, micro_batches=2,
          optimizer=slidedp.AdamW(lr=1e-3, weight_decay=0.1))
KEPT_ONLY = SolverOptions(host_copies=("kept",))


def _train(engine, steps=3):
    gen = torch.Generator().manual_seed(5)
    losses = [engine.step(*random_batch(gen, 4 * BATCH)) for _ in range(steps)]  # two passes of 2 micro-batches
    return losses, {k: v.clone() for k, v in engine.state_dict().items()}


def test_a_tight_host_budget_trains_exactly_as_with_every_copy_kept():
    model = make_model("llama")
    kept = slidedp.compile(copy.deepcopy(model), "1GiB", plan=slidedp.plan(model, "1GiB", solver_options=KEPT_ONLY,
                                                                            **KW), **KW)
    full = kept.plan.peak_host_bytes
    assert kept.plan.copies_made_on_load() == ()
    losses_kept, weights_kept = _train(kept)
    kept.close()

    lean = slidedp.compile(copy.deepcopy(model), "1GiB", host_memory=full - 1, **KW)
    made = lean.plan.copies_made_on_load()
    assert made and lean.plan.peak_host_bytes < full
    for i, layer in enumerate(lean.host.layers):
        assert (layer.delivery is None) == (i in made)
    saved = sum(mem.host_copy_bytes(lean.graph.layers[i].numel, 2) for i in made)
    assert lean.host.nbytes == lean.plan.host_memory["state"] and lean.plan.host_memory["state"] == \
        kept.plan.host_memory["state"] - saved
    losses_lean, weights_lean = _train(lean)
    lean.close()
    assert losses_lean == losses_kept
    for name, w in weights_kept.items():
        assert torch.equal(weights_lean[name], w), name


def test_every_copy_made_on_load_and_a_checkpoint_crosses_layouts(tmp_path):
    """A plan with every copy made on load trains like the kept one; a checkpoint written under one
    layout resumes under the other, bit for bit."""
    model = make_model("qwen3")
    kept = slidedp.plan(model, "1GiB", solver_options=KEPT_ONLY, **KW)
    all_on_load = kept.replace(decisions=tuple(replace(d, host_copy="on_load") for d in kept.decisions))

    def make(plan):
        engine = slidedp.compile(copy.deepcopy(model), "1GiB", plan=plan, **KW)
        assert all((layer.delivery is None) == (plan is all_on_load) for layer in engine.host.layers)
        return engine

    gen = torch.Generator().manual_seed(9)
    layouts_agree_and_checkpoints_cross(make, kept, all_on_load, [random_batch(gen, 2 * BATCH) for _ in range(4)],
                                        tmp_path)


def layouts_agree_and_checkpoints_cross(make, plan_a, plan_b, batches, tmp_path):
    """Engines of two plans (`make(plan)`) on the same batches: the same losses and state, bit for bit;
    the checkpoint each writes halfway, resumed under the other plan, gives that state again."""
    a, b = make(plan_a), make(plan_b)
    half = len(batches) // 2
    for ids, labels in batches[:half]:
        assert a.step(ids, labels) == b.step(ids, labels)
    a.save_checkpoint(tmp_path / "a")
    b.save_checkpoint(tmp_path / "b")
    for ids, labels in batches[half:]:
        assert a.step(ids, labels) == b.step(ids, labels)
    expected = a.state_dict()
    assert all(torch.equal(w, expected[k]) for k, w in b.state_dict().items())
    a.close()
    b.close()
    for source, plan in ((tmp_path / "a", plan_b), (tmp_path / "b", plan_a)):
        with make(plan) as engine:
            engine.load_checkpoint(source)
            for ids, labels in batches[half:]:
                engine.step(ids, labels)
            for name, w in engine.state_dict().items():
                assert torch.equal(w, expected[name]), (source.name, name)


def test_on_load_is_refused_in_fp32():
    model = make_model("llama")
    plan = slidedp.plan(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    bad = plan.replace(decisions=tuple(replace(d, host_copy="on_load") for d in plan.decisions))
    with pytest.raises(ValueError, match="host_copy 'on_load' has no meaning in fp32"):
        bad.validate()


@pytest.mark.parametrize("route", [pytest.param(("replicated", "cpu"), marks=pytest.mark.slow), ("sharded", "gpu")])
def test_two_ranks_with_copies_made_on_load_train_as_with_them_kept(route):
    """Worker processes map the host state without the copies of the layers that make them on load;
    each rank's loads (every chunk, or its own chunks broadcast) cast the master: the same run, bit
    for bit, as with every copy kept."""
    model = make_model("llama")
    options = SolverOptions(host_copies=("kept",), deliveries=(route[0],), reductions=(route[1],))
    kw = dict(KW, world_size=2)
    kept_plan = slidedp.plan(model, "1GiB", hardware="h100-sxm", solver_options=options, compile_blocks=False,
                             **kw)  # eager blocks: no compile in each worker
    lean_plan = kept_plan.replace(decisions=tuple(replace(d, host_copy="on_load") for d in kept_plan.decisions))
    runs = []
    for plan in (kept_plan, lean_plan):
        with slidedp.compile(copy.deepcopy(model), "1GiB", plan=plan, **kw) as engine:
            runs.append(_train(engine, steps=2))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(w, runs[1][1][k]) for k, w in runs[0][1].items())
