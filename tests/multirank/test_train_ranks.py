"""`slidedp train` with world_size=2 (CPU worker processes): the same run as one rank, and exact resume."""

import pytest
import torch

from slidedp.run.checkpoint import read_master_weights
from slidedp.train.job import list_checkpoints, run
from tests.train.conftest import tiny_jsonl, tiny_model_dir, tiny_tokenizer  # noqa: F401 - fixtures
from tests.train.test_job import config


def test_two_ranks_train_like_one_and_resume_exactly(tiny_model_dir, tiny_jsonl, tmp_path):
    data = tiny_jsonl[0]
    one = run(config(tiny_model_dir, data, tmp_path / "one", "batch_size=4", "world_size=1"))
    two = run(config(tiny_model_dir, data, tmp_path / "two", "batch_size=2", "world_size=2"))
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)  # same rows per step, split over 2 ranks
    w1 = read_master_weights(list_checkpoints(tmp_path / "one")[-1][1])
    w2 = read_master_weights(list_checkpoints(tmp_path / "two")[-1][1])
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=name)

    half = tmp_path / "half"
    first = run(config(tiny_model_dir, data, half, "batch_size=2", "world_size=2", "max_steps=2"))
    second = run(config(tiny_model_dir, data, half, "batch_size=2", "world_size=2", "resume=true"))
    assert first["losses"] + second["losses"] == two["losses"]
    w3 = read_master_weights(list_checkpoints(half)[-1][1])
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
