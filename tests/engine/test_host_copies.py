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
    kept = slidedp.compile(copy.deepcopy(model), "1GiB", plan=slidedp.plan(model, "1GiB", solver_options=KEPT_ONLY,
                                                                            **KW), **KW)
    all_on_load = kept.plan.replace(decisions=tuple(replace(d, host_copy="on_load") for d in kept.plan.decisions))
    lean = slidedp.compile(copy.deepcopy(model), "1GiB", plan=all_on_load, **KW)
    assert all(layer.delivery is None for layer in lean.host.layers)
    gen = torch.Generator().manual_seed(9)
    batches = [random_batch(gen, 2 * BATCH) for _ in range(4)]
    for ids, labels in batches[:2]:
        assert kept.step(ids, labels) == lean.step(ids, labels)
    kept.save_checkpoint(tmp_path / "kept")
    lean.save_checkpoint(tmp_path / "lean")
    for ids, labels in batches[2:]:
        assert kept.step(ids, labels) == lean.step(ids, labels)
    expected = kept.state_dict()
    kept.close()  # its plan stays readable
    lean.close()
    # kept -> on load and on load -> kept
    for source, plan in ((tmp_path / "kept", all_on_load), (tmp_path / "lean", kept.plan)):
        engine = slidedp.compile(copy.deepcopy(model), "1GiB", plan=plan, **KW)
        engine.load_checkpoint(source)
        for ids, labels in batches[2:]:
            engine.step(ids, labels)
        for name, w in engine.state_dict().items():
            assert torch.equal(w, expected[name]), (source.name, name)
        engine.close()


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
    kept_plan = slidedp.plan(model, "1GiB", hardware="h100-sxm", solver_options=options, **kw)
    lean_plan = kept_plan.replace(decisions=tuple(replace(d, host_copy="on_load") for d in kept_plan.decisions))
    runs = []
    for plan in (kept_plan, lean_plan):
        with slidedp.compile(copy.deepcopy(model), "1GiB", plan=plan, **kw) as engine:
            runs.append(_train(engine, steps=2))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(w, runs[1][1][k]) for k, w in runs[0][1].items())
