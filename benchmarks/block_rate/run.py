"""How fast a Qwen3-4B block and its causal attention run as the sequence grows, on this GPU.

    python benchmarks/block_rate/run.py --seq 4096 16384 65536 262144 --out block_rate.json

For each sequence length (batch 1): the FLOPs of one block's forward and backward as slidedp's IR
counts them (calibrate.count_block_flops_fwd_bwd), the part of them that is attention (causal, half
of the query-key pairs: slidedp.ir.export_trace), the time of the whole eager block forward +
backward (calibrate.measure_block_fwd_bwd_s) and of SDPA alone (forward, and forward + backward;
calibrate.measure_attention_s) at the block's heads, bf16. The cost model turns these into a rate
for attention beside the rate of the rest of the block (Hardware.attention_flops_per_s).
CUDA-event medians in one process.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# run as a script: the repository root first (this checkout's slidedp and benchmarks package)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[2]))
from benchmarks.common.records import add_allow_dirty, commit_stamp  # noqa: E402

import argparse
import json
from pathlib import Path

import torch

from slidedp.profiler import calibrate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (smoke test, fp32)")
    p.add_argument("--out", type=Path, required=True)
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    base = calibrate.QWEN3_4B_BLOCK
    device = torch.device(args.device)
    rows = []
    for seq in args.seq:
        shape = calibrate.BlockShape(**{**base.__dict__, "seq_len": seq})
        fwd_flops, bwd_flops = calibrate.count_block_flops_fwd_bwd(shape)
        att_fwd, att_bwd = calibrate.attention_flops_fwd_bwd(shape)
        block_s = calibrate.measure_block_fwd_bwd_s(device, shape, repeats=args.repeats)
        sdpa_fwd_s, sdpa_fwd_bwd_s = calibrate.measure_attention_s(device, shape, repeats=args.repeats)
        row = dict(seq=seq, block_flops_fwd=fwd_flops, block_flops_bwd=bwd_flops,
                   attention_flops_fwd=att_fwd, attention_flops_bwd=att_bwd, block_fwd_bwd_s=block_s,
                   sdpa_fwd_s=sdpa_fwd_s, sdpa_fwd_bwd_s=sdpa_fwd_bwd_s,
                   block_flops_per_s=(fwd_flops + bwd_flops) / block_s,
                   sdpa_fwd_flops_per_s=att_fwd / sdpa_fwd_s,
                   sdpa_fwd_bwd_flops_per_s=(att_fwd + att_bwd) / sdpa_fwd_bwd_s,
                   rest_flops_per_s=(fwd_flops + bwd_flops - att_fwd - att_bwd) / max(block_s - sdpa_fwd_bwd_s, 1e-9))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.write_text(json.dumps(dict(**stamp, device=name, torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
