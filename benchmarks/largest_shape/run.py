"""Which Qwen3 shapes' host state fits this machine's RAM (random init, bf16, nothing allocated).

    python benchmarks/largest_shape/run.py --out largest_shape.json
    python benchmarks/largest_shape/run.py --device-state 100GiB   # one GPU holding part of the state

For each shape (Qwen3 0.6B .. 32B, as their published configs give them, untied embeddings from
4B up): builds the model on the meta device, makes its layer graph and counts the host state that
`slidedp.compile` would allocate (`slidedp.run.preflight.host_state_bytes`: fp32 master weights, both
AdamW moments, the bf16 delivery copy and bf16 gradients, page-aligned), against this machine's
available host RAM (MemAvailable, or the cgroup limit) less compile's headroom. The largest shape
that fits is the one to run; the first that does not says what limits it.

`--device-state BYTES`: a one-rank run whose plan keeps the optimizer state of leading layers on the
GPU (prologue, then blocks in order, as the planner does) within that many bytes
(`costmodel.memory.device_state_bytes`, 12 B + the gradient per parameter); the host then holds none
of those layers' state (the lean host state of a one-rank `slidedp.compile`).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# run as a script: the repository root first (this checkout's slidedp and benchmarks package)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import argparse
import json
import sys

import torch

# hidden, intermediate, blocks, heads, kv heads, head_dim, vocab, tied (Qwen3 model cards / configs)
SHAPES = {
    "0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "4b": (2560, 9728, 36, 32, 8, 128, 151936, False),
    "8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "14b": (5120, 17408, 40, 40, 8, 128, 151936, False),
    "32b": (5120, 25600, 64, 64, 8, 128, 151936, False),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--device-state", default="0", help="device memory for optimizer state, e.g. 100GiB")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    stamp = commit_stamp(args.allow_dirty)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from slidedp.budget import Budget, format_bytes
    from slidedp.costmodel.memory import device_state_bytes
    from slidedp.ir.build import build_layer_graph
    from slidedp.run.preflight import HOST_HEADROOM_BYTES, host_available_bytes, host_state_bytes

    available = host_available_bytes()
    on_device_bytes = Budget.parse(args.device_state).device_bytes if args.device_state != "0" else 0
    rows = []
    for name, (h, i, n, heads, kv, hd, vocab, tied) in SHAPES.items():
        cfg = Qwen3Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                          num_key_value_heads=kv, head_dim=hd, vocab_size=vocab, tie_word_embeddings=tied,
                          use_cache=False)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        graph = build_layer_graph(model, batch_size=1, seq_len=args.seq, compute_dtype=torch.bfloat16)
        lean, used, lean_params = [], 0, 0
        for layer in graph.layers[:-1]:  # prologue, then blocks in order
            used += device_state_bytes(layer.numel, 2)
            if used > on_device_bytes:
                break
            lean.append(layer.id)
            lean_params += layer.numel
        need = host_state_bytes(graph, precision="bf16", lean_layers=lean)
        fits = available is None or need + HOST_HEADROOM_BYTES <= available
        rows.append({"shape": name, "params": params, "host_state_bytes": need, "fits": fits,
                     "bytes_per_param": need / params, "device_state_layers": len(lean),
                     "device_state_params": lean_params})
        print(f"Qwen3-{name:5} {params / 1e9:6.2f} B params: host state {format_bytes(need):>10} "
              f"({need / params:.2f} bytes/param; state of {len(lean)} of {len(graph.layers)} layers on the "
              f"device) -> {'fits' if fits else 'does not fit'}", flush=True)
    largest = max((r for r in rows if r["fits"]), key=lambda r: r["params"], default=None)
    print(f"available host RAM: {format_bytes(available) if available is not None else 'unknown'}; "
          f"largest that fits: {largest['shape'] if largest else 'none'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**stamp, "available_host_bytes": available, "headroom_bytes": HOST_HEADROOM_BYTES,
                       "device_state_bytes": on_device_bytes,
                       "shapes": rows, "largest": largest and largest["shape"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
