"""plan.summary() says why the chosen routes win on each preset (world_size 4)."""

import re

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import slidedp
from slidedp.scheduler.decisions import SolverOptions

# the explanations compare each decision of whatever plan is found; a short search is enough
SHORT = SolverOptions(deterministic_time=0.2)


@pytest.fixture(scope="module")
def meta_model():
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


def block_routes(plan):
    return {(d.delivery, d.reduction) for d in plan.decisions if d.kind == "block"}


def test_no_peer_to_peer_means_replicated_delivery_and_cpu_reduction(meta_model):
    plan = slidedp.plan(meta_model, "8GiB", batch_size=1, seq_len=2048, world_size=4, hardware="rtx4090",
                        solver_options=SHORT)
    assert block_routes(plan) == {("replicated", "cpu")}
    text = plan.summary()
    assert "no GPU peer-to-peer on rtx4090" in text
    assert re.search(r"bounce through the host \([\d.]+ ms.*\) against [\d.]+ ms to copy it whole", text)


@pytest.mark.parametrize("preset", ["h100-sxm", "h200-sxm"])
def test_peer_to_peer_routes_are_compared_with_their_predicted_step(meta_model, preset):
    # a budget that leaves blocks streamed (with more, every layer's optimizer state is on the GPUs;
    # sharded over the 4 ranks, it all fits 2 GiB: a full copy on each rank here)
    plan = slidedp.plan(meta_model, "2GiB", batch_size=1, seq_len=2048, world_size=4, hardware=preset,
                        solver_options=SolverOptions(deterministic_time=0.2, device_state_sharded=False))
    streamed = {(d.delivery, d.reduction) for d in plan.decisions
                if d.kind == "block" and d.layer_id not in plan.device_state}
    assert streamed
    text = plan.summary()
    for what in ("delivery", "reduction"):
        line = next(l for l in text.splitlines() if l.strip().startswith(f"{what} of the blocks:"))
        # "<chosen> <what>: X ms; <runner-up> <what>: Y ms (+Z ms)": the chosen one is never slower
        times = [float(t) for t in re.findall(r": ([\d.]+) ms", line)]
        assert len(times) >= 2 and times[0] <= times[1], line
        chosen = line.split(":", 2)[1].split()[0]
        assert chosen in {r[0 if what == "delivery" else 1] for r in streamed}
    # GPU reduction wins with fast peer-to-peer: the host sums W gradient copies otherwise
    assert {r for _, r in streamed} == {"gpu"}
