"""Which scaled-dot-product-attention kernel is fastest for a Qwen3 block on this GPU.

    python benchmarks/attention_backends/run.py --out attention.json

Times the forward + backward of causal attention at the Qwen3-4B shape (32 query / 8 key-value
heads, head_dim 128, 4,096-token rows, bf16) for each SDPA backend PyTorch offers (flash, cuDNN,
memory-efficient), with grouped-query attention passed as `enable_gqa` and as repeated key-value
heads, then a whole Hugging Face `Qwen3DecoderLayer` run through `torch.compile` with each backend
first in SDPA's priority order. Errors are against fp32 attention of the same inputs. Every time is
the median of CUDA-event timings in one process, so the rows are comparable as ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common import model as bench  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def attention_rows(rows: int, seq: int, heads: int, kv: int, hd: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(rows, kv, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(rows, kv, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(rows, heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    rep = heads // kv

    def run(backend, gqa: bool, q, k, v):
        with sdpa_kernel([backend]):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  is_causal=True)

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(rep, 1),
                                             leaves[2].repeat_interleave(rep, 1), is_causal=True)
    ref.backward(dout.float())
    ref_grads = [t.grad for t in leaves]
    # causal: half of the query-key pairs; forward 2 matmuls, backward 5 (2.5x)
    flops = 4 * rows * heads * seq * seq * hd * 0.5 * 3.5
    out = []
    for name, backend in BACKENDS.items():
        for gqa in (True, False):
            row = {"backend": name, "gqa": "enable_gqa" if gqa else "repeat_kv"}
            try:
                xs = [t.detach().requires_grad_() for t in (q, k, v)]

                def step():
                    for t in xs:
                        t.grad = None
                    run(backend, gqa, *xs).backward(dout)

                step()
                got = run(backend, gqa, *xs)
                row["out_rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
                row["grad_rel_err"] = max(((x.grad.float() - r).norm() / r.norm()).item()
                                          for x, r in zip(xs, ref_grads))
                row["fwd_bwd_ms"] = time_ms(step)
                row["tflops"] = flops / row["fwd_bwd_ms"] / 1e9
            except RuntimeError as e:  # the backend refuses this shape or GQA form
                row["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def block_rows(rows: int, seq: int) -> list[dict]:
    """A compiled Qwen3DecoderLayer of the 4B shape, forward + backward, per SDPA backend."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = bench.qwen3_config("4b")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(cfg, 0).to("cuda", torch.bfloat16)
    rope = Qwen3RotaryEmbedding(cfg).to("cuda")
    x = torch.randn(rows, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")[None].expand(rows, seq)
    cos_sin = rope(x, pos)
    dy = torch.randn_like(x)

    def call(h):
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    result = []
    ref = None
    for name in ["default", *BACKENDS]:
        torch._dynamo.reset()
        fn = torch.compile(call, dynamic=False)
        h = x.detach().requires_grad_()
        order = [BACKENDS[name]] + [b for b in BACKENDS.values() if b != BACKENDS[name]] if name in BACKENDS else None
        row = {"block_backend": name}
        try:
            def step():
                layer.zero_grad(set_to_none=True)
                h.grad = None
                if order is None:
                    y = fn(h)
                else:
                    with sdpa_kernel(order, set_priority=True):
                        y = fn(h)
                y.backward(dy)
                return y

            y = step()
            if ref is None:
                ref = (y.detach().float(), h.grad.float())
            row["out_rel_err_vs_default"] = ((y.detach().float() - ref[0]).norm() / ref[0].norm()).item()
            row["dx_rel_err_vs_default"] = ((h.grad.float() - ref[1]).norm() / ref[1].norm()).item()
            row["fwd_bwd_ms_per_4096_tokens"] = time_ms(step, iters=10) * 4096 / (rows * seq)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run here is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        result.append(row)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--skip-block", action="store_true")
    p.add_argument("--out", required=True)
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    s = bench.SHAPES["4b"]
    result = {**stamp, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows, "seq": args.seq,
              "attention": attention_rows(args.rows, args.seq, s["heads"], s["kv_heads"], s["head_dim"])}
    if not args.skip_block:
        result["block"] = block_rows(args.rows, args.seq)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
