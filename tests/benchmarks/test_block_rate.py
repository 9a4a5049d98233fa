"""benchmarks/block_rate: attention apart from the rest of a block."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_block_rate_splits_attention_from_the_rest_of_a_block(tmp_path):
    """benchmarks/block_rate on the CPU (fp32, a short sequence): its FLOP counts are the IR's
    (attention the causal formula's share of the block's) and every rate follows from its times."""
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "block_rate" / "run.py"), "--device", "cpu",
                           "--seq", "64", "--repeats", "1", "--out", str(out), "--allow-dirty"],
                          capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["attention_flops_fwd"] == 2 * 64 * 64 * 32 * 128  # causal: half of 4 s^2 h d
    assert row["attention_flops_bwd"] == 5 * 64 * 64 * 32 * 128
    total = row["block_flops_fwd"] + row["block_flops_bwd"]
    assert 0 < row["attention_flops_fwd"] + row["attention_flops_bwd"] < total
    assert row["block_flops_per_s"] == pytest.approx(total / row["block_fwd_bwd_s"])
    assert row["sdpa_fwd_s"] > 0 and row["sdpa_fwd_bwd_s"] > 0
