"""One decoder block's device memory, measured on the GPU, against what the layer IR counts for it.

For each sequence length: the IR's counts for a block of the Qwen3 shape (`build_layer_graph` on the
meta device: saved activations, workspace, boundary), and one eager bf16 forward with autograd then
the backward of the same block on the GPU (what a recomputed block's backward runs), with
`torch.cuda.max_memory_allocated` above what was allocated before (the block's input and weights):

    python benchmarks/block_memory/run.py --seq 4096 65536 262144 --out block_memory.json

The footprint (scheduler/problem/footprint.py) charges a recomputed block's backward its saved activations,
its workspace and its parameters' gradients, beside the boundary activations it keeps anyway; the
measured peak above the input is compared with saved + workspace + parameter gradients + the
block's output (the one boundary the measurement allocates beyond its input).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402


def one_block_model(shape: str, device: str):
    import torch
    from transformers import Qwen3ForCausalLM

    from benchmarks.common.model import qwen3_config

    cfg = qwen3_config(shape)
    cfg.num_hidden_layers = 1
    if device == "meta":
        with torch.device("meta"):
            return Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    return model.eval()


def ir_counts(shape: str, seq: int) -> dict:
    import torch

    from slidedp.ir.build import build_layer_graph

    graph = build_layer_graph(one_block_model(shape, "meta"), batch_size=1, seq_len=seq,
                              compute_dtype=torch.bfloat16)
    block = graph.blocks[0]
    c = block.costs
    return {"saved_bytes": c.saved_activation_bytes, "workspace_bytes": c.peak_workspace_bytes,
            "boundary_bytes": c.boundary_activation_bytes, "param_grads_bytes": block.numel * 2,
            "charged_bytes": c.saved_activation_bytes + c.peak_workspace_bytes + block.numel * 2
            + c.boundary_activation_bytes}


def measure(shape: str, seq: int, device: str) -> dict:
    import torch

    model = one_block_model(shape, device)
    block = model.model.layers[0]
    hidden = torch.randn(1, seq, model.config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(seq, device=device)[None]
    position_embeddings = model.model.rotary_emb(hidden, position_ids)
    params = [p for p in block.parameters()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = block(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - base
    after_forward = torch.cuda.memory_allocated() - base
    grads = torch.autograd.grad(out, [hidden] + params, torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads, out
    return {"forward_peak_bytes": forward_peak, "after_forward_bytes": after_forward, "peak_bytes": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4b")
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 65536, 262144])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    stamp = commit_stamp(args.allow_dirty)
    rows = []
    for seq in args.seq:
        row = {"seq": seq, **ir_counts(args.shape, seq)}
        row.update(stamp)
        if args.device != "meta":
            row.update(measure(args.shape, seq, args.device))
            row["measured_over_charged"] = row["peak_bytes"] / row["charged_bytes"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
