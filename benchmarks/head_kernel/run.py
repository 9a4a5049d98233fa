"""The fused linear + cross-entropy on the GPU: the executor's path against the alternatives, one run.

    python benchmarks/head_kernel/run.py --tokens 4096 --out head_kernel.json

Qwen3-4B head (hidden 2560, vocabulary 151936, bf16), one evaluation = loss, grad_hidden and grad_weight
of `--tokens` tokens (one chunk of the executor's `loss_chunk_tokens`). Systems, each timed over
`--repeats` evaluations after two warm-up ones, in the same process:

  fused:    `linear_cross_entropy` (cuBLAS logits in fp32, Triton row kernel, two cuBLAS GEMMs)
  tiled:    the autograd Function's path (Triton tiled forward + Triton dlogits + two cuBLAS GEMMs)
  eager:    torch: bf16 logits, F.cross_entropy on them in fp32, autograd (what a Hugging Face
            head does under bf16)

It also reports each against fp32 ground truth (loss, relative error of both gradients) and the
rate as a fraction of `--matmul-flops-per-s` (the `head_efficiency` of a hardware profile:
6 * T * V * H FLOPs per evaluation).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# run as a script: the repository root first (this checkout's slidedp and benchmarks package)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import argparse
import json
import time

import torch
import torch.nn.functional as F

from slidedp.backend.kernels import linear_cross_entropy as lce


def timed(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--matmul-flops-per-s", type=float, default=786e12)
    ap.add_argument("--out")
    add_allow_dirty(ap)
    a = ap.parse_args()
    stamp = commit_stamp(a.allow_dirty)
    T, H, V = a.tokens, a.hidden, a.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, device="cuda", generator=g)).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    scale = 1.0 / T

    def fused():
        return lce.linear_cross_entropy(hidden, weight, labels, scale=scale, chunk_tokens=T)

    def tiled():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        loss = lce.LinearCrossEntropy.apply(h, w, labels, scale, T)
        loss.backward()
        return loss, h.grad, w.grad

    def eager():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        loss = F.cross_entropy((h @ w.T).float(), labels, reduction="sum") * scale
        loss.backward()
        return loss, h.grad, w.grad

    h32 = hidden.float().requires_grad_(True)
    w32 = weight.float().requires_grad_(True)
    ref_loss = F.cross_entropy(h32 @ w32.T, labels, reduction="sum") * scale
    ref_loss.backward()

    def rel(x, ref):
        return float((x.float() - ref).norm() / ref.norm())

    flops = 6 * T * V * H
    records = []
    for name, fn in (("fused", fused), ("tiled", tiled), ("eager", eager)):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        s = timed(fn, a.repeats)
        out = fn()
        loss, gh, gw = (out.loss, out.grad_hidden, out.grad_weight) if name == "fused" else out
        records.append(dict(system=name, seconds=s, tflops_per_s=flops / s / 1e12,
                            head_efficiency=flops / s / a.matmul_flops_per_s,
                            peak_extra_bytes=torch.cuda.max_memory_allocated() - base,
                            loss=float(loss), loss_rel_err=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                            grad_hidden_rel_err=rel(gh, h32.grad), grad_weight_rel_err=rel(gw, w32.grad)))
        print(json.dumps(records[-1]), flush=True)
    fused_s = records[0]["seconds"]
    for r in records:
        r["time_vs_fused"] = r["seconds"] / fused_s
    result = dict(**stamp, tokens=T, hidden=H, vocab=V, repeats=a.repeats, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, fp32_out_matmul=lce._FP32_OUT_MATMUL.get("cuda"), records=records)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
