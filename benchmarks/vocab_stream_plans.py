"""Plan figures of the vocabulary-streamed embedding and head (predicted by slidedp.plan; docs/design.md §4.14):
the Qwen3-4B shape's device floor on one GPU, the Qwen2.5-72B shape on 4 x rtx4090 at 24 GiB.
Usage: PYTHONPATH=. python benchmarks/vocab_stream_plans.py [4b] [72b]"""
import sys, time
import torch, transformers, slidedp
from slidedp.errors import InfeasibleBudgetError
GiB = 1 << 30

def meta(cls, **kw):
    cfg = getattr(transformers, cls)(max_position_embeddings=40960, **kw)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)

def qwen3_4b():
    return meta("Qwen3Config", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)

def qwen25_72b():
    return meta("Qwen2Config", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)

def floor(model, seq, **kw):
    try:
        p = slidedp.plan(model, "1GiB", batch_size=1, seq_len=seq, hardware=kw.pop("hardware", "h200-sxm"), **kw)
        return p.peak_device_bytes, None
    except InfeasibleBudgetError as e:
        return e.min_budget_bytes, e

which = sys.argv[1:] or ["4b", "72b"]
if "4b" in which:
    m = qwen3_4b()
    for seq in (4096, 16384):
        t = time.time()
        fl, _ = floor(m, seq)
        print(f"Qwen3-4B seq {seq}: min_budget {fl / GiB:.2f} GiB ({fl} B) ({time.time() - t:.0f}s)", flush=True)
        p = slidedp.plan(m, int(fl) + (64 << 20), batch_size=1, seq_len=seq, hardware="h200-sxm")
        print("   memory at floor:", {k: round(v / GiB, 3) for k, v in p.memory.items() if v})
if "72b" in which:
    m = qwen25_72b()
    for seq in (4096, 512):
        t = time.time()
        try:
            p = slidedp.plan(m, "24GiB", batch_size=1, seq_len=seq, world_size=4, hardware="rtx4090")
            print(f"72B 4x rtx4090 seq {seq}: step {p.predicted_step_time_s:.2f} s peak {p.peak_device_bytes / GiB:.2f} GiB "
                  f"host {p.peak_host_bytes / GiB:.1f} GiB ({time.time() - t:.0f}s)")
            print("   memory:", {k: round(v / GiB, 3) for k, v in p.memory.items() if v})
            print("   host:", {k: round(v / GiB, 2) for k, v in p.host_memory.items() if v})
            print(p.summary())
        except InfeasibleBudgetError as e:
            print(f"72B seq {seq}: infeasible, min_budget {e.min_budget_bytes / GiB:.2f} GiB ({time.time() - t:.0f}s)")
