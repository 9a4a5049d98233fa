"""What a compiled decoder block saves for its backward, and what its backward computes, as AOTAutograd's
activation memory budget lowers: the partitioner's trade between keeping activations and recomputing
them, for one micro-batch of a benchmark shape. No GPU: the block is traced on fake tensors and split as
Inductor splits it (slidedp.ir.compiled_saved.partition_block); each graph's FLOPs are counted as the
layer IR counts them.

    python benchmarks/block_memory/partial_recompute.py --shape 4b --rows 2 \
        --out benchmarks/block_memory/results/DATE-partial-recompute-4b.json

Budget 1 is what a kept or offloaded compiled block saves today; `recompute` runs the whole forward
again in the backward (its FLOPs are the forward's), saving only the block's input. A budget between
them is a block that would save part of its activations and recompute the rest (not a policy of the
planner).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.model import SHAPES  # noqa: E402
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.common.tables import markdown_table  # noqa: E402

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0)


def graph_flops(gm) -> float:
    """FLOPs of one run of an fx graph on its placeholders' fake values (the IR's formulas)."""
    from torch.utils.flop_counter import FlopCounterMode

    from slidedp.ir.export_trace import EXTRA_FLOP_FORMULAS

    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        gm(*values)
    return float(counter.get_total_flops())


def budget_rows(shape: str, rows: int, budgets=BUDGETS) -> list[dict]:
    """For each budget: the bytes one micro-batch of `rows` sequences saves, the forward's and the
    backward's FLOPs, and the backward's FLOPs above budget 1's as a share of the forward's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from benchmarks.block_memory.run import one_block_model
    from slidedp.ir.compiled_saved import partition_block

    s = SHAPES[shape]
    block = one_block_model(shape, "meta").model.layers[0]
    out = []
    with FakeTensorMode():
        params = {n: torch.empty(p.shape, dtype=torch.bfloat16, requires_grad=True) for n, p in block.named_parameters()}
        hidden = torch.empty(rows, s["seq"], s["hidden"], dtype=torch.bfloat16, requires_grad=True)
        rotary = tuple(torch.empty(rows, s["seq"], s["head_dim"], dtype=torch.bfloat16) for _ in range(2))
        for budget in budgets:
            part = partition_block(block, params, (hidden,), dict(attention_mask=None, position_embeddings=rotary),
                                   memory_budget=budget, backward=True)
            out.append({"budget": budget, "saved_bytes": part.saved_bytes, "fwd_flops": graph_flops(part.forward),
                        "bwd_flops": graph_flops(part.backward)})
    full = next(r for r in out if r["budget"] == 1.0) if 1.0 in budgets else out[0]
    for r in out:
        r["recomputed_share_of_fwd"] = (r["bwd_flops"] - full["bwd_flops"]) / r["fwd_flops"]
    return out


def render(rows: list[dict]) -> str:
    return markdown_table(["budget", "saved MiB", "forward TFLOP", "backward TFLOP", "recomputed, share of forward"],
                          [[f"{r['budget']:g}", f"{r['saved_bytes'] / 2**20:,.0f}", f"{r['fwd_flops'] / 1e12:.3f}",
                            f"{r['bwd_flops'] / 1e12:.3f}", f"{r['recomputed_share_of_fwd']:.2f}"] for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    p.add_argument("--rows", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS),
                   help="activation memory budgets, each in [0, 1] (1 first: the others' recompute is against it)")
    p.add_argument("--out", help="the record to write")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    if args.rows < 1 or not all(0.0 <= b <= 1.0 for b in args.budgets):
        p.error("--rows must be positive and every --budgets value in [0, 1]")
    stamp = commit_stamp(args.allow_dirty)
    rows = budget_rows(args.shape, args.rows, tuple(args.budgets))
    print(render(rows))
    if args.out:
        write_records(Path(args.out), {**stamp, "command": "python " + " ".join(sys.argv), "shape": args.shape,
                                       "rows": args.rows, "seq": SHAPES[args.shape]["seq"], "budgets": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
