"""GPU acceptance of the streamed step: a Qwen3-shaped model larger than its budget trains under the
budget and matches a GPU-resident reference; plus a first throughput reading on the Qwen3-4B shape.

    python benchmarks/gpu_streamed_step/run.py correctness --out result.json
    python benchmarks/gpu_streamed_step/run.py throughput --size 4b --tokens 4096 16384 --out result.json

The reference is plain PyTorch on the same GPU: fp32 parameters, bf16 autocast, torch.optim.AdamW
(fused), the same batches. slidedp computes with bf16 weights, so agreement is to bf16 tolerance.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# run as a script: the repository root first (this checkout's slidedp and benchmarks package)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import argparse
import copy
import dataclasses
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F

import slidedp
from slidedp.backend.lowering.verify import verify_program
from slidedp.ir.blocks import logits_of

SHAPES = {
    # hidden, intermediate, blocks, heads, kv heads, head_dim, vocab
    "small": (1024, 3072, 32, 16, 8, 64, 16000),
    "4b": (2560, 9728, 36, 32, 8, 128, 151936),
}


def qwen3(size: str, seed: int = 0, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, i, n, heads, kv, hd, vocab = SHAPES[size]
    cfg = Qwen3Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, vocab_size=vocab, tie_word_embeddings=False,
                      max_position_embeddings=32768)
    # Fast deterministic init: allocate on the meta device, then fill in place (HF's own init of
    # 4 B parameters takes minutes on the CPU); the rotary table is rebuilt for real.
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


def batches(vocab: int, rows: int, seq: int, steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, seq), generator=gen) for _ in range(steps)]


def correctness(args) -> dict:
    model = qwen3("small")
    ref = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())
    budget = slidedp.Budget.parse(args.budget).device_bytes
    data = batches(model.config.vocab_size, args.rows, args.seq, args.steps)
    lr = 1e-4

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kwargs = dict(batch_size=args.batch, seq_len=args.seq, device="cuda", precision="bf16",
                  optimizer=slidedp.AdamW(lr=lr), micro_batches=args.rows // args.batch)
    plan = None
    if args.policy == "mixed":  # cycle keep / offload / recompute over the blocks, 2 chunks per layer
        plan = slidedp.plan(model, budget, **kwargs)
        cycle = ["keep", "offload", "recompute"]
        decisions = tuple(dataclasses.replace(d, chunks=2, activation=cycle[i % 3] if d.kind == "block" else d.activation)
                          for i, d in enumerate(plan.decisions))
        plan = dataclasses.replace(plan, decisions=decisions)
    engine = slidedp.compile(model, budget, plan=plan, **kwargs)
    simulated_peak = verify_program(engine.executor.program).peak_device_bytes
    print(engine.plan.summary(), flush=True)
    w0 = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = [engine.step(ids) for ids in data]
    peak = torch.cuda.max_memory_allocated() - base
    w_slide = engine.state_dict()
    predicted_peak = engine.plan.peak_device_bytes
    engine.close()
    del model, engine

    ref = ref.cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, fused=True)
    ref_losses = []
    for ids in data:
        ids = ids.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = logits_of(ref(ids)).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    num = den = 0.0
    for name, p in ref.named_parameters():
        d_ref = p.detach().float().cpu() - w0[name]
        d_sl = w_slide[name] - w0[name]
        num += float((d_sl - d_ref).pow(2).sum())
        den += float(d_ref.pow(2).sum())
    weights_bf16_bytes = 2 * n_params
    return {
        "test": "correctness", "params": n_params, "budget_bytes": budget,
        "bf16_weight_bytes": weights_bf16_bytes, "model_larger_than_budget": weights_bf16_bytes > budget,
        "max_memory_allocated_bytes": int(peak), "under_budget": peak <= budget,
        "predicted_peak_device_bytes": int(predicted_peak), "policy": args.policy,
        "program_simulated_peak_bytes": int(simulated_peak),
        "losses_slidedp": losses, "losses_reference": ref_losses,
        "loss_rel_diff": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)],
        "update_rel_l2_error": (num / den) ** 0.5,
    }


def throughput(args) -> list[dict]:
    records = []
    model = qwen3(args.size, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    for tokens in args.tokens:
        rows = tokens // args.seq
        t0 = time.perf_counter()
        engine = slidedp.compile(model, args.budget, batch_size=1, seq_len=args.seq, device="cuda",
                                 precision="bf16", micro_batches=rows, hardware=args.hardware,
                                 max_grad_norm=args.max_grad_norm)
        compile_s = time.perf_counter() - t0
        print(engine.plan.summary(), flush=True)
        data = batches(model.config.vocab_size, rows, args.seq, args.steps + 1)
        torch.cuda.reset_peak_memory_stats()
        engine.step(data[0])  # warm-up
        torch.cuda.synchronize()
        steps = []
        for ids in data[1:]:
            t0 = time.perf_counter()
            engine.step(ids)
            info = engine.last_step
            steps.append({"step_s": time.perf_counter() - t0, "pass_s": info.pass_s, "wait_s": info.wait_s,
                          "previous_update_s": engine.updates.last_duration_s})
        engine.updates.flush()
        torch.cuda.synchronize()
        step_s = sum(s["step_s"] for s in steps) / len(steps)
        records.append({
            "system": "slidedp", "size": args.size, "params": n_params, "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_s, "measured_step_s": step_s,
            "predicted_step_s": engine.plan.predicted_step_time_s, "predicted": engine.plan.predicted,
            "window": engine.plan.window, "activation": [d.activation for d in engine.plan.decisions],
            "peak_device_bytes": torch.cuda.max_memory_allocated(), "predicted_peak_device_bytes": engine.plan.peak_device_bytes,
            "budget_bytes": slidedp.Budget.parse(args.budget).device_bytes, "steps": steps,
            "last_update_s": engine.updates.last_duration_s, "compile_s": compile_s,
            "max_grad_norm": args.max_grad_norm,
        })
        print(json.dumps(records[-1]), flush=True)
        engine.close()
    return records


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["correctness", "throughput"])
    p.add_argument("--budget", default="640MiB")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", default="4b")
    p.add_argument("--policy", choices=["recompute", "mixed"], default="recompute")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--hardware", default=None, help="a preset name or a calibrated profile JSON")
    p.add_argument("--max-grad-norm", type=float, default=None)
    p.add_argument("--out", required=True)
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    result = correctness(args) if args.what == "correctness" else throughput(args)
    meta = {**stamp, "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "result": result}, f, indent=1)
    print(json.dumps(result, indent=1) if isinstance(result, dict) else "", flush=True)


if __name__ == "__main__":
    main()
