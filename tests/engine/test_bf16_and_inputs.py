"""bf16 precision tracks the fp32 reference; bad input is refused with a clear message."""

import copy

import pytest
import torch

import slidedp
from tests.engine.test_exactness import BATCH, SEQ, random_batch, reference_loss
from tests.models import VOCAB, make_model

# bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%); weights and activations are
# rounded at every layer of a 3-block model, so the loss of a ~4.6-nat model moves by well under
# 1%. 1e-2 relative leaves a margin of several times what is observed (about 1e-3).
BF16_LOSS_RTOL = 1e-2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_loss_tracks_fp32_reference(family):
    model = make_model(family)
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="bf16",
                             optimizer=slidedp.AdamW(lr=1e-3), micro_batches=2)
    gen = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(5):
        ids, labels = random_batch(gen, 2 * BATCH)
        losses.append(engine.step(ids, labels))
        ref_loss = reference_loss(ref, ids, labels)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=BF16_LOSS_RTOL, atol=0.0)
    # The delivery copy is the master rounded to bf16 (round-to-nearest-even), bit for bit.
    layer = engine.host.layers[1]
    assert torch.equal(layer.delivery, layer.master.to(torch.bfloat16))
    engine.close()


def compile_llama(**overrides):
    kwargs = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    kwargs.update(overrides)
    budget = kwargs.pop("budget", "1GiB")
    return slidedp.compile(make_model("llama"), budget, **kwargs)


@pytest.mark.parametrize("budget, error, words", [
    ("lots", ValueError, "cannot parse budget"),
    ("12 parsecs", ValueError, "cannot parse budget"),
    (-5, ValueError, "positive"),
    (0, ValueError, "positive"),
    (3.5, ValueError, "whole number"),
    ([1], TypeError, "budget must be"),
])
def test_bad_budget(budget, error, words):
    with pytest.raises(error, match=words):
        compile_llama(budget=budget)


@pytest.mark.parametrize("kwargs, words", [
    (dict(batch_size=0), "batch_size"),
    (dict(seq_len=1), "seq_len"),
    (dict(precision="fp8"), "precision"),
    (dict(device="tpu"), "device"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
])
def test_bad_compile_arguments(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        compile_llama(**kwargs)


def test_too_small_budget_reports_minimum():
    with pytest.raises(slidedp.InfeasibleBudgetError) as info:
        compile_llama(budget="10KiB")
    minimum = info.value.min_budget_bytes
    assert minimum > 10 * 1024
    compile_llama(budget=minimum).close()  # the reported minimum works


def test_bad_step_inputs_name_the_problem():
    engine = compile_llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with pytest.raises(ValueError, match="multiple of"):
        engine.step(torch.randint(0, VOCAB, (BATCH + 1, SEQ)))
    with pytest.raises(ValueError, match="seq_len=16"):
        engine.step(torch.randint(0, VOCAB, (BATCH, SEQ + 1)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.step(ids + VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.step(ids - VOCAB)
    with pytest.raises(TypeError, match="integer"):
        engine.step(ids.float())
    with pytest.raises(ValueError, match="labels"):
        engine.step(ids, labels=torch.full((BATCH, SEQ), VOCAB + 3))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        engine.step(ids, labels=ids.float() + 0.5)  # not truncated to other token ids
    with pytest.raises(ValueError, match="-100"):
        engine.step(ids, labels=torch.full((BATCH, SEQ), -100))
    with pytest.raises(ValueError, match="attention_mask"):
        engine.step(ids, attention_mask=torch.full((BATCH, SEQ), 2))
    assert engine.host.step == 0  # nothing was stepped by any of these
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step(ids)


def test_model_without_blocks_is_refused():
    class NoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 8)
            self.head = torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids):
            return self.head(self.emb(input_ids))

    with pytest.raises(slidedp.UnsupportedModelError, match="ModuleList of blocks"):
        slidedp.compile(NoBlocks(), "1GiB", batch_size=1, seq_len=8, device="cpu")
    with pytest.raises(TypeError, match="nn.Module"):
        slidedp.compile("gpt2", "1GiB", batch_size=1, seq_len=8, device="cpu")


def test_non_finite_gradient_skips_the_step():
    engine = compile_llama(optimizer=slidedp.AdamW(lr=1e-2))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    engine.step(ids)
    before = engine.state_dict()
    moments = [layer.exp_avg.clone() for layer in engine.host.layers]
    step_before = engine.host.step
    with torch.no_grad():  # poison one weight: the gradient becomes non-finite
        engine.host.layers[2].master[0] = float("inf")
        engine.host.layers[2].master[0] = float("nan")
    loss = engine.step(ids)
    assert engine.last_step.skipped and engine.skipped_steps == 1
    assert engine.host.step == step_before
    assert not torch.isfinite(torch.tensor(loss)) or engine.last_step.skipped
    after = engine.state_dict()
    for name in before:
        if name != next(iter(engine.host.layers[2].param_views(engine.host.layers[2].master))):
            torch.testing.assert_close(after[name], before[name], equal_nan=True)
    for layer, m in zip(engine.host.layers, moments):
        assert torch.equal(layer.exp_avg, m)
    engine.close()


def test_close_frees_and_model_keeps_trained_weights():
    model = make_model("llama")
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=1e-2))
    engine.step(torch.randint(0, VOCAB, (BATCH, SEQ)))
    trained = engine.state_dict()
    engine.close()
    engine.close()  # twice is fine
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name])


@pytest.mark.parametrize("available_bytes,keep", [(0, None), (None, False)])
def test_close_without_room_for_the_weights_leaves_them_on_meta(monkeypatch, caplog, available_bytes, keep):
    """Copies of the trained weights that do not fit the host RAM available (or keep_weights=False) are
    not made: the parameters go to the meta device, with their shapes; without room, a warning says so."""
    import slidedp.run.engine as engine_module

    monkeypatch.setattr(engine_module, "host_available_bytes", lambda: available_bytes)
    model = make_model("llama")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=1e-2))
    engine.step(torch.randint(0, VOCAB, (BATCH, SEQ)))
    with caplog.at_level("WARNING", logger="slidedp"):
        engine.close(keep_weights=keep)
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    assert all(p.device.type == "meta" for p in model.parameters() if p.requires_grad)
    assert ("without copies of the trained weights" in caplog.text) == (keep is None)


def test_compile_reports_the_time_of_each_phase(caplog):
    """A long build is not silent: each phase is logged at INFO with its seconds, in the order it ran."""
    with caplog.at_level("INFO", logger="slidedp"):
        engine = compile_llama()
    engine.close()
    timed = [r for r in caplog.records if hasattr(r, "phase")]
    assert [r.phase for r in timed] == ["traced", "planned", "lowered", "host state allocated", "weights written",
                                        "rank built"]
    assert all(r.seconds >= 0 and r.getMessage() == f"slidedp: {r.phase}: {r.seconds:.1f} s" for r in timed)
    caplog.clear()
    with caplog.at_level("INFO", logger="slidedp"):  # a given plan is checked, not solved
        compile_llama(plan=engine.plan).close()
    assert [r.phase for r in caplog.records if hasattr(r, "phase")][1] == "plan checked"
