"""Which measured configurations each hardware preset's fitted coefficients were fitted on, so that a
prediction table can say, per row, whether the row was used in fitting (and so proves little) or is
held out. The history of each fit is in benchmarks/LOG.md ("Cost-model coefficients").

h200-sxm: every coefficient fitted to whole steps (block, compiled-block and head efficiencies, the
host's issue times, the contended CPU AdamW fractions, cpu_adamw_backward_fraction) was fitted on
Qwen3-4B-shape runs on the H200 host (4,096 to 262,144 tokens per step, 24 to 120 GiB budgets).
Other shapes (Qwen3-8B, the Llama-3.2-3B shape) were never fitted on.
"""

from __future__ import annotations

# preset -> the record fields that, all matching, mark a configuration used in fitting
FITTED_ON: dict[str, tuple[dict, ...]] = {
    "h200-sxm": ({"shape": "4b"},),
}


def used_in_fitting(record: dict, hardware: str) -> bool:
    """Whether `record` (a benchmark record: shape, tokens_per_step, ...) is of a configuration the
    coefficients of preset `hardware` were fitted on. A calibrated profile (not a preset name) was
    fitted on nothing but its own micro-benchmarks: every run is held out for it."""
    return any(all(record.get(k, "4b" if k == "shape" else None) == v for k, v in rule.items())
               for rule in FITTED_ON.get(hardware, ()))
