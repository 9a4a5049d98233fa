"""benchmarks/block_memory/partial_recompute.py: a lower activation memory budget saves fewer bytes and
recomputes more in the backward, on fake tensors; budget 1 saves what the IR charges a compiled block."""

from __future__ import annotations

import json

import torch

from benchmarks.block_memory.partial_recompute import budget_rows, main
from benchmarks.common.model import empty_model
from slidedp.ir.build import build_layer_graph


def test_a_lower_budget_saves_less_and_recomputes_more(tmp_path):
    rows = budget_rows("tiny", 2, (1.0, 0.3, 0.0))
    full, part, none = rows
    assert full["recomputed_share_of_fwd"] == 0.0
    assert full["saved_bytes"] > part["saved_bytes"] >= none["saved_bytes"] > 0
    assert full["bwd_flops"] <= part["bwd_flops"] < none["bwd_flops"]
    assert 0.5 < none["recomputed_share_of_fwd"] <= 1.0  # most of the forward again, never more than all of it
    assert {r["fwd_flops"] for r in rows} == {full["fwd_flops"]}  # the forward itself does not change
    # budget 1: about the bytes the layer IR charges a compiled block of that shape (compiled_saved_bytes; the
    # IR traces the block with the model's own call, whose rotary tensors differ by a few KiB here)
    model = empty_model("tiny", dtype=torch.bfloat16, device="meta")
    graph = build_layer_graph(model, batch_size=2, seq_len=32, compiled_blocks=True)
    assert abs(graph.layers[1].costs.saved_activation_bytes / full["saved_bytes"] - 1) < 0.05
    out = tmp_path / "r.json"
    assert main(["--shape", "tiny", "--budgets", "1", "0", "--out", str(out), "--allow-dirty"]) == 0
    record = json.loads(out.read_text())
    assert [r["budget"] for r in record["budgets"]] == [1.0, 0.0] and record["seq"] == 32
