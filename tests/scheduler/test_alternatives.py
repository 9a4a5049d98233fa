"""No plan is slower than an alternative it explains itself with: every 'why' line compares the
chosen decision against its runner-up, simulated with everything else of the plan unchanged, and
the runner-up is never faster (a short search that stops early is finished by local search)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import slidedp
from slidedp.scheduler.decisions import SolverOptions

SHORT = SolverOptions(deterministic_time=0.1)
# the sweeps' own alternatives compare choices each solved in full (device state), or are labelled
# with the sweep's figures (streamed updates)
SWEEPS = ("optimizer state on the device", "streamed updates")


def _qwen3():
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


def _llama():
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=5, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=16000)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


CASES = [
    (_qwen3, "2GiB", 4, "h200-sxm", None),
    (_qwen3, "3GiB", 4, "h100-sxm", None),
    (_qwen3, "8GiB", 4, "rtx4090", None),
    (_llama, "1500MiB", 1, "h200-sxm", None),  # one rank: early and streamed updates allowed
    (_llama, "3GiB", 2, "h100-sxm", 1.0),  # clipping: no early updates
]


@pytest.mark.parametrize("make,budget,world,preset,clip", CASES)
def test_no_alternative_is_faster_than_the_plan(make, budget, world, preset, clip):
    plan = slidedp.plan(make(), budget, batch_size=1, seq_len=2048, world_size=world, hardware=preset,
                        max_grad_norm=clip, solver_options=SHORT)
    tick = plan.solver["tick_s"]
    compared = [a for a in plan.alternatives if a.runner_up_step_s is not None and a.decision not in SWEEPS]
    assert compared, plan.summary()
    for a in compared:
        assert a.chosen_step_s == pytest.approx(plan.predicted["step_s"])
        assert a.runner_up_step_s >= a.chosen_step_s - tick, a.reason
