"""The GPU-resident baseline's best configuration: the fewest checkpointed blocks that fit, found by
a binary search over probes, and only blocks 0..k-1 checkpointed."""

import pytest
import torch

from benchmarks.common.model import checkpoint_leading_blocks, empty_model, fewest_checkpointed


@pytest.mark.parametrize("n,need", [(36, 0), (36, 1), (36, 17), (36, 35), (36, 36), (1, 1), (5, 3)])
def test_fewest_checkpointed_is_the_least_that_fits(n, need):
    probes = []

    def fits(k):
        probes.append(k)
        return k >= need

    k, tried = fewest_checkpointed(n, fits)
    assert k == need and tried == probes
    assert len(tried) <= max(1, n).bit_length()  # a binary search, not a sweep
    assert n not in tried  # every block checkpointed is assumed to fit: never probed


def test_checkpointing_only_the_leading_blocks():
    model = empty_model("tiny", dtype=torch.float32, device="cpu")
    n = len(model.model.layers)
    checkpoint_leading_blocks(model, 1)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True] + [False] * (n - 1)
    checkpoint_leading_blocks(model, 0)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
