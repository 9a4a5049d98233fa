"""Mixture-of-experts blocks: their grouped matmuls counted (slidedp/ir/export_trace.py grouped_mm_flops)
and a Hugging Face MoE model trained as torch.optim.AdamW trains it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import slidedp
from slidedp.ir.build import build_layer_graph
from slidedp.ir.export_trace import EXTRA_FLOP_FORMULAS, grouped_mm_flops

moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(torch.ops.aten, "_grouped_mm") or "batched_mm" not in getattr(moe, "ALL_EXPERTS_FUNCTIONS", {}):
    pytest.skip("no grouped matmul in this torch, or no selectable experts implementation in this transformers",
                allow_module_level=True)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402


def _counted(fn) -> int:
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        fn()
    return counter.get_total_flops()


def test_grouped_mm_counts_what_its_matmuls_one_group_at_a_time_count():
    """Rows split over three groups ([M, K] x [G, K, N]) and a weight gradient split along K ([K, M] x
    [M, N]): the formula against torch's own mm formula over the groups one by one."""
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # an empty group in the middle
    x, w = torch.randn(8, 16), torch.randn(3, 16, 4)
    starts = [0, 3, 3]

    def one_by_one():
        for g, (lo, hi) in enumerate(zip(starts, offs.tolist())):
            torch.mm(x[lo:hi], w[g])

    assert _counted(lambda: torch.ops.aten._grouped_mm(x, w, offs=offs)) == _counted(one_by_one) == 2 * 8 * 16 * 4
    dy = torch.randn(8, 4)
    assert grouped_mm_flops((16, 8), (8, 4)) == _counted(lambda: [torch.mm(x.t()[:, lo:hi], dy[lo:hi])
                                                                 for lo, hi in zip(starts, offs.tolist())])


def _moe(experts: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=64)).float()
    model.config._experts_implementation = experts
    return model


def test_a_moe_block_counts_its_experts(monkeypatch):
    """The grouped-matmul experts (bf16, as on a GPU) cost the FLOPs of the same experts gathered a token at
    a time (batched matmuls, which torch's own formulas count): in the forward, 2 x tokens x experts a token
    x hidden x expert width for each of gate, up and down more than with grouped matmuls left uncounted."""
    grouped = build_layer_graph(_moe("grouped_mm"), batch_size=1, seq_len=32, compute_dtype=torch.bfloat16)
    batched = build_layer_graph(_moe("batched_mm"), batch_size=1, seq_len=32, compute_dtype=torch.bfloat16)
    g, b = grouped.blocks[0].costs, batched.blocks[0].costs
    assert g.flops_fwd == b.flops_fwd and g.flops_bwd == b.flops_bwd
    monkeypatch.delitem(EXTRA_FLOP_FORMULAS, torch.ops.aten._grouped_mm)
    uncounted = build_layer_graph(_moe("grouped_mm"), batch_size=1, seq_len=32, compute_dtype=torch.bfloat16)
    assert g.flops_fwd - uncounted.blocks[0].costs.flops_fwd == 3 * 2 * 32 * 2 * 64 * 32


def test_a_moe_model_trains_as_torch_adamw_trains_it():
    """Qwen3-MoE (its routing picks each token's experts from the data) against torch.optim.AdamW, three
    steps of two micro-batches with clipping; fp32 on the CPU, whose fake grouped matmul wants bf16, so its
    experts run batched."""
    from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, train_side_by_side

    model = _moe("batched_mm")
    ref = copy.deepcopy(model)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, micro_batches=2)
    with engine:
        train_side_by_side(engine, ref, steps=3, seed=1)


def test_a_moe_block_at_fp32_is_refused_with_the_way_out():
    """On the CPU at fp32 the experts' grouped matmul cannot run on fake tensors (torch's fake kernel takes
    bf16): refused naming the block and saying to plan in bf16, where it traces (test above)."""
    from slidedp.errors import UnsupportedModelError

    try:
        build_layer_graph(_moe("grouped_mm"), batch_size=1, seq_len=32, compute_dtype=torch.float32)
    except UnsupportedModelError as e:
        assert "model.layers.0" in str(e) and "precision='bf16'" in str(e)
    else:
        pytest.skip("this torch traces an fp32 grouped matmul on fake tensors")
