"""The CPU update of step t overlaps step t+1 and the result is still exact; errors surface."""

import copy
import time

import pytest
import torch

import slidedp
from slidedp.backend import cpu_adamw
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side
from tests.models import VOCAB, make_model


def test_slow_updates_are_waited_for_and_stay_exact(monkeypatch):
    real = cpu_adamw.adamw_step
    calls = []

    def slow_step(*args, **kwargs):
        time.sleep(0.005)  # the next step reaches its waits before the update is done
        calls.append(time.perf_counter())
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_adamw, "adamw_step", slow_step)
    model = make_model("qwen2", tied=True)
    ref = copy.deepcopy(model).eval()
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, micro_batches=2)
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=7)
    assert len(calls) >= 3 * len(engine.graph.layers)


def test_an_update_error_is_raised_not_lost(monkeypatch):
    model = make_model("llama")
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")

    def broken(*args, **kwargs):
        raise RuntimeError("optimizer exploded")

    monkeypatch.setattr(cpu_adamw, "adamw_step", broken)
    engine.step(torch.randint(0, VOCAB, (BATCH, SEQ)))  # the update runs in the background
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        engine.step(torch.randint(0, VOCAB, (BATCH, SEQ)))
    monkeypatch.undo()
    engine.close()
