"""Host memory of a multi-rank engine against one rank: the host state must exist once.

    python benchmarks/host_memory_ranks/run.py --world-sizes 1 4 --out result.json

For each world size, in a fresh process: build a Llama-shaped model whose training state dominates
(many blocks, small vocabulary), compile it on the CPU (worker processes for world_size > 1), take
two steps, then sum the proportional set size (PSS: a shared page counts 1/n in each of the n
processes mapping it, so the shared host state counts once) of the controller and every worker.
On the CPU the ranks' "device" buffers (weight slots, activations) are host memory too; on GPUs
they are not, so this measures an upper bound of the per-rank host cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.hostmem import smaps_bytes  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402


def measure(world_size: int, args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import slidedp

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.blocks,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab,
                      tie_word_embeddings=False, max_position_embeddings=args.seq)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the build's peak (fp32 masters are made from it)
    model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    kwargs = dict(batch_size=1, seq_len=args.seq, world_size=world_size, device="cpu", precision=args.precision)
    budget = args.budget
    if budget == "min":  # the smallest budget the solver can plan in: one weight slot per rank
        try:
            slidedp.plan(model, 1, **kwargs)
        except slidedp.InfeasibleBudgetError as e:
            budget = e.min_budget_bytes
    engine = slidedp.compile(model, budget, **kwargs)
    ids = torch.randint(0, args.vocab, (world_size, args.seq))
    t0 = time.perf_counter()
    for _ in range(2):
        engine.step(ids)
    engine.updates.flush()
    step_s = (time.perf_counter() - t0) / 2
    pids = [os.getpid()] + ([p.pid for p in engine.runner.procs] if world_size > 1 else [])
    per_process = {pid: smaps_bytes(pid) for pid in pids}
    record = {
        "world_size": world_size,
        "params": sum(p.numel() for p in model.parameters()),
        "host_state_bytes": engine.host.nbytes,
        "budget_bytes": engine.plan.budget_bytes,
        "window": engine.plan.window,
        "pss_bytes_total": sum(per_process.values()),
        "pss_bytes_per_process": list(per_process.values()),
        "anonymous_bytes_per_process": [smaps_bytes(pid, "Anonymous") for pid in pids],
        "step_s": step_s,
    }
    engine.close()
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--budget", default="64GiB", help="per-rank device budget; 'min': the smallest plannable")
    p.add_argument("--out")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one world size
    add_allow_dirty(p)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args)))
        return
    stamp = commit_stamp(args.allow_dirty)
    records = []
    for w in args.world_sizes:  # each in a fresh process, so nothing of one run is counted in the next
        cmd = [sys.executable, __file__, "--one", str(w), "--blocks", str(args.blocks), "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--seq", str(args.seq), "--precision", args.precision, "--budget", args.budget]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        records.append(json.loads(out.strip().splitlines()[-1]))
        print(f"world_size={w}: PSS {records[-1]['pss_bytes_total'] / 2**30:.2f} GiB "
              f"(host state {records[-1]['host_state_bytes'] / 2**30:.2f} GiB)", flush=True)
    base = records[0]["pss_bytes_total"]
    for r in records:
        r["ratio_to_first"] = r["pss_bytes_total"] / base
    result = {**stamp, "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "date": time.strftime("%Y-%m-%d"),
              "hardware": f"{os.cpu_count()} CPU cores, no GPU", "records": records}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
