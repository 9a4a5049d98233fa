"""Learning-rate schedules: warm-up, then constant, linear or cosine decay to min_lr."""

import math

import pytest

from slidedp.train.schedule import lr_at


def lrs(schedule, warmup=0, max_steps=10, lr=1.0, min_lr=0.0):
    return [lr_at(s, lr=lr, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr=min_lr)
            for s in range(1, max_steps + 1)]


def test_constant_and_warmup():
    assert lrs("constant") == [1.0] * 10
    assert lrs("constant", warmup=4) == [0.25, 0.5, 0.75] + [1.0] * 7


def test_linear_decay():
    assert lrs("linear", warmup=2, max_steps=6, lr=2.0, min_lr=1.0) == [1.0, 2.0, 2.0, 1.75, 1.5, 1.25]
    assert lr_at(50, lr=2.0, schedule="linear", warmup_steps=2, max_steps=6, min_lr=1.0) == 1.0  # past the end


def test_cosine_decay():
    values = lrs("cosine", max_steps=4, lr=1.0, min_lr=0.1)
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert values == pytest.approx(expected)
    assert values[0] == 1.0 and all(a > b for a, b in zip(values, values[1:])) and values[-1] > 0.1


def test_bad_schedule():
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        lr_at(1, lr=1.0, schedule="step")
    with pytest.raises(ValueError, match="step must be >= 1"):
        lr_at(0, lr=1.0)
