"""A long run: 1,000 steps of the tiny model on CPU (checkpoints and validation every 100 steps);
the process's RSS, measured every 100 steps, grows by less than 5% from step 100 to step 1,000.

Slow (about a minute on 2 cores): deselected by default, run with `pytest -m slow`.
"""

import json
import sys

import pytest

from tests.reliability.conftest import overrides, start_train

STEPS, EVERY = 1000, 100


@pytest.mark.slow
def test_rss_is_flat_over_1000_steps(rel_model_dir, rel_data, tmp_path):
    out = tmp_path / "long"
    proc = start_train(overrides(rel_model_dir, rel_data, out, f"max_steps={STEPS}", f"save_every={EVERY}",
                                 "keep_last=2", f"log_every={EVERY}", "val_fraction=0.1", f"val_every={EVERY}",
                                 "warmup_steps=10", "lr_schedule=cosine", "lr=1e-3"))
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rss = {r["step"]: r["host_rss_bytes"] for r in records if r["step"] % EVERY == 0}
    growth = rss[STEPS] / rss[EVERY] - 1
    table = ", ".join(f"{s}: {b / 2**20:.1f} MiB" for s, b in sorted(rss.items()))
    print(f"\nRSS every {EVERY} steps: {table}; growth from step {EVERY} to {STEPS}: {growth:+.2%}", file=sys.stderr)
    step_s = sorted(r["step_s"] for r in records)
    print(f"step time median {step_s[len(step_s) // 2] * 1e3:.1f} ms", file=sys.stderr)
    assert growth < 0.05, table
    assert max(rss.values()) / rss[EVERY] - 1 < 0.05, table
    assert records[-1]["loss"] < records[0]["loss"]
