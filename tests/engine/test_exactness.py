"""slidedp's step against torch.optim.AdamW on the plain PyTorch model (CPU, fp32)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import slidedp
from tests.models import FAMILIES, VOCAB, make_model
from slidedp.ir.blocks import logits_of

SEQ, BATCH = 16, 2
LR, WD, CLIP = 1e-3, 0.1, 0.5


def reference_loss(model, ids, labels):
    logits = logits_of(model(ids)).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def random_batch(gen, rows):
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    labels = ids.clone()
    labels[torch.rand(rows, SEQ, generator=gen) < 0.25] = -100
    return ids, labels


def train_side_by_side(engine, ref, steps, seed, clip=CLIP, lr=LR, wd=WD, opt=None):
    """`steps` steps of the engine and of torch.optim.AdamW on `ref` (`opt`, or a new one), on the same
    random batches; asserts the losses agree, then that every parameter agrees."""
    opt = opt or torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, labels = random_batch(gen, 2 * BATCH)  # 2 micro-batches of accumulation
        loss = engine.step(ids, labels)
        ref_loss = reference_loss(ref, ids, labels)
        opt.zero_grad()
        ref_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    state = engine.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)
    return state


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_torch_adamw(family, tied, micro_batches):
    model = make_model(family, tied=tied)
    ref = copy.deepcopy(model).eval()
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP,
                             micro_batches=micro_batches)
    with engine:
        state = train_side_by_side(engine, ref, steps=5, seed=1)
        assert engine.last_step.clip_coef < 1.0, "the test must exercise clipping"
        if tied:
            assert len(state) > len(dict(ref.named_parameters()))  # both tied names are reported


def test_unequal_tokens_per_micro_batch_are_token_weighted():
    """One micro-batch almost fully masked: the loss is the mean over all valid tokens."""
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ))
    labels = ids.clone()
    labels[:BATCH, 3:] = -100
    loss = engine.step(ids, labels)
    assert loss == pytest.approx(reference_loss(ref, ids, labels).item(), rel=1e-5)
    engine.close()


def test_no_decay_groups_exempt_norms_and_embeddings():
    model = make_model("llama")
    opt_cfg = slidedp.AdamW(lr=0.0, weight_decay=0.5, no_decay_groups=True)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=opt_cfg)
    before = engine.state_dict()
    engine.step(torch.randint(0, VOCAB, (BATCH, SEQ)))
    after = engine.state_dict()
    # lr = 0: nothing moves at all, decay included (decay is lr * wd).
    for name in before:
        torch.testing.assert_close(after[name], before[name])
    engine.close()
    model = make_model("llama")
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=1e-2, weight_decay=0.5, no_decay_groups=True))
    groups = {p.name: p.no_decay for layer in engine.graph.layers for p in layer.params}
    assert groups["model.norm.weight"] and groups["model.embed_tokens.weight"]
    assert not groups["model.layers.0.mlp.up_proj.weight"]
    engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_takes_the_clipping_norm_on_the_device(family, monkeypatch):
    """One rank, one pass, every layer's state on the host: each layer's sum of squares is the one taken
    on the device (one rank copies its gradient down, Routes.gradient), not a pass over the host
    gradient at the step boundary; the step still clips as torch.optim.AdamW with clip_grad_norm_ does."""
    from slidedp.backend.runtime import routes

    def no_host_pass(*args, **kwargs):
        raise AssertionError("the host gradient was read for the norm")

    monkeypatch.setattr(routes, "_sumsq", no_host_pass)
    model = make_model(family)
    ref = copy.deepcopy(model).eval()
    kw = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32", max_grad_norm=CLIP, micro_batches=2)
    plan = slidedp.plan(model, "1GiB", solver_options=slidedp.SolverOptions(  # every layer's state on the host
        device_state_blocks=0, device_state_prologue=False, streamed_layers=0), **kw)
    engine = slidedp.compile(model, "1GiB", plan=plan, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), **kw)
    with engine:
        assert not engine.plan.schedule.device_state and not engine.plan.schedule.streamed_updates
        train_side_by_side(engine, ref, steps=3, seed=2)
        assert engine.last_step.clip_coef < 1.0, "the test must exercise clipping"
