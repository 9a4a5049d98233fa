"""At long sequences the blocks' inputs (the boundary stash) set the device floor: Qwen3-4B at 65,536
tokens per step (16 micro-batches of 4096) needs 11.88 GiB of them alone. With their inputs offloaded
(recompute_offload) a 13.6 GiB budget on an H200 plans; without, it is refused."""

import dataclasses

import pytest
import torch

import slidedp
from benchmarks.common.model import empty_model
from slidedp.scheduler.decisions import SolverOptions

GiB = 2**30


@pytest.mark.slow
def test_qwen3_4b_at_65536_tokens_fits_13_6_gib_by_offloading_block_inputs():
    model = empty_model("4b", dtype=torch.bfloat16, device="cpu")
    kwargs = dict(batch_size=1, seq_len=4096, precision="bf16", micro_batches=16, hardware="h200-sxm",
                  max_grad_norm=None, host_memory="110GiB")
    plan = slidedp.plan(model, "13.6GiB", **kwargs)
    offloaded = [d.layer_id for d in plan.decisions if d.activation == "recompute_offload"]
    assert plan.peak_device_bytes <= 13.6 * GiB and len(offloaded) > 20
    assert plan.host_memory["offloaded_activations"] >= 16 * len(offloaded) * 4096 * 2560 * 2  # bf16 inputs
    assert "block inputs offloaded" in plan.summary()
    without = dataclasses.replace(SolverOptions(), activations=("recompute", "keep", "offload"))
    with pytest.raises(slidedp.InfeasibleBudgetError):
        slidedp.plan(model, "13.6GiB", solver_options=without, **kwargs)
