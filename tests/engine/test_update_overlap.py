"""The CPU update of step t overlaps step t+1 and the result is still exact; errors surface."""

import copy
import time

import pytest
import torch

import slidedp
from slidedp.backend.kernels import cpu_adamw
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


@pytest.mark.parametrize("order", ["forward", "head_first"])
def test_updates_follow_the_plans_update_order(monkeypatch, order):
    """The CPU updates run in the plan's update order (the solver may put the head first), and the
    result is exact either way."""
    model = make_model("llama", tied=False)
    ref = copy.deepcopy(model).eval()
    kwargs = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    plan = slidedp.plan(model, "1GiB", **kwargs)
    n = len(plan.decisions)
    blocks = tuple(range(1, n - 1))
    want = (0, n - 1) + blocks if order == "head_first" else (0,) + blocks + (n - 1,)
    plan = plan.replace(update_order=want)
    engine = slidedp.compile(model, "1GiB", optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP,
                             plan=plan, **kwargs)
    spans = [(engine.host.layers[i].master.data_ptr(),
              engine.host.layers[i].master.data_ptr() + 4 * engine.host.layers[i].master.numel()) for i in range(n)]
    seen = []
    real = cpu_adamw.adamw_step

    def recording_step(param, *args, **kw):
        layer = next(i for i, (lo, hi) in enumerate(spans) if lo <= param.ctypes.data < hi)
        if not seen or seen[-1] != layer:
            seen.append(layer)
        return real(param, *args, **kw)

    monkeypatch.setattr(cpu_adamw, "adamw_step", recording_step)
    with engine:
        train_side_by_side(engine, ref, steps=2, seed=3)
    assert tuple(seen) == want * 2


def test_a_plan_whose_update_order_misses_a_layer_is_refused():
    model = make_model("llama")
    kwargs = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32")
    plan = slidedp.plan(model, "1GiB", **kwargs)
    plan = plan.replace(update_order=plan.update_order[:-1])
    with pytest.raises(ValueError, match="update_order"):
        slidedp.compile(model, "1GiB", plan=plan, **kwargs)
