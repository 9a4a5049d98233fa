"""The multi-rank code path on one GPU: one rank in a worker process against the in-process engine.

    python benchmarks/gpu_worker_path/run.py --out result.json

A machine with one GPU cannot run two NCCL ranks, but one rank in a worker process runs everything
a rank of a multi-GPU engine runs except the collectives with peers: the spawned process, the job
skeleton, the host state mapped from another process and registered with CUDA there, NCCL's
process group, pinned staging, the CPU reduction in turn, the update flags. Both engines train the
same Qwen3-shaped model on the same batches; the losses and weights must agree to bf16 tolerance
(the clip coefficient differs in the last bits: one takes the norm on the GPU, the other on the host).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# run as a script: the repository root first (this checkout's slidedp and benchmarks package)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import argparse
import json
import os
import time

import torch


def make_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def train(workers: bool, batches, args) -> dict:
    import slidedp

    os.environ["SLIDEDP_WORKER_PROCESSES"] = "1" if workers else "0"
    model = make_model()
    engine = slidedp.compile(model, args.budget, batch_size=1, seq_len=args.seq, device="cuda",
                             micro_batches=batches[0].shape[0], max_grad_norm=1.0,
                             optimizer=slidedp.AdamW(lr=1e-4))
    losses, times = [], []
    with engine:
        for ids in batches:
            t0 = time.perf_counter()
            losses.append(engine.step(ids))
            times.append(time.perf_counter() - t0)
        state = engine.state_dict()
        procs = len(engine.runner.procs) if workers else 0
    return {"losses": losses, "step_s": times, "state": state, "worker_processes": procs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--out", required=True)
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (args.rows, args.seq), generator=gen) for _ in range(args.steps)]
    a = train(False, batches, args)
    b = train(True, batches, args)
    rel = max(float((b["state"][k] - a["state"][k]).norm() / a["state"][k].norm().clamp_min(1e-12)) for k in a["state"])
    result = {
        **stamp,
        "command": "python benchmarks/gpu_worker_path/run.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "allow_dirty")),
        "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
        "in_process": {k: a[k] for k in ("losses", "step_s")},
        "worker_process": {k: b[k] for k in ("losses", "step_s", "worker_processes")},
        "max_relative_weight_difference": rel,
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
