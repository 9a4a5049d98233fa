"""Which measured configurations each hardware preset's fitted coefficients were fitted on, so that a
prediction table can say, per row, whether the row was used in fitting (and so proves little) or is
held out. The history of each fit is in benchmarks/LOG.md ("Cost-model coefficients").

h200-sxm: every coefficient fitted to whole steps (block, compiled-block and head efficiencies, the
host's issue times, the contended CPU AdamW fractions, cpu_adamw_backward_fraction) was fitted on
Qwen3-4B-shape runs on the H200 host (4,096 to 262,144 tokens per step, 24 to 120 GiB budgets).
Other shapes (Qwen3-8B, the Llama-3.2-3B shape) were never fitted on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from slidedp.costmodel.hardware import step_fits_suffix

# preset -> the record fields that, all matching, mark a configuration used in fitting
FITTED_ON: dict[str, tuple[dict, ...]] = {
    "h200-sxm": ({"shape": "4b"},),
}


def used_in_fitting(record: dict, hardware: str) -> bool:
    """Whether `record` (a benchmark record: shape, tokens_per_step, ...) is of a configuration the
    coefficients of preset `hardware` were fitted on. A calibrated profile (not a preset name) was
    fitted on nothing but its own micro-benchmarks: every run is held out for it; one with the h200-sxm
    step fits (with_step_fits) was fitted on what those were."""
    if hardware and STEP_FITS_SUFFIX in hardware:  # its block's rate scaled to the model's, or not
        hardware = "h200-sxm"
    return any(all(record.get(k, "4b" if k == "shape" else None) == v for k, v in rule.items())
               for rule in FITTED_ON.get(hardware, ()))


GOAL_ERROR = 0.10  # a held-out prediction counts as right within 10% of the measured step


def within_goal(measured_s: float, predicted_s: float) -> bool:
    """Whether a prediction is within GOAL_ERROR of the measured step (measured / predicted - 1)."""
    return abs(measured_s / predicted_s - 1) <= GOAL_ERROR


# the card each hardware preset describes: a plan for one preset run on another card predicts nothing
PRESET_CARD = {"h200-sxm": "H200", "h100-sxm": "H100"}

STEP_FITS_SUFFIX = step_fits_suffix("h200-sxm")  # a profile with_step_fits made (slidedp/costmodel/hardware.py)


def card_of(preset: str | None) -> str:
    """The card a plan's hardware describes: a preset's (PRESET_CARD), or the one a calibrated profile
    measured (its name, "calibrated:CARD", with or without the step fits); "?" if neither."""
    if preset and preset.startswith("calibrated:"):
        return preset.split(":", 1)[1].split(STEP_FITS_SUFFIX)[0]
    return PRESET_CARD.get(preset, "?")


def prediction_rows(results: Path) -> list[dict]:
    """Every slidedp point of the records in `results` (single_gpu_throughput's) whose step time was
    predicted before its run (`predicted_utc` before `measure_start_utc`) on the card its plan's preset
    describes, with whether the preset's coefficients were fitted on its configuration."""
    rows = []
    for path in sorted(Path(results).glob("*.json")):
        records = json.loads(path.read_text())
        for r in records if isinstance(records, list) else ():
            if (r.get("error") is not None or "predicted_utc" not in r or not r.get("median_step_s")
                    or not r["predicted_utc"] < r.get("measure_start_utc", "")):
                continue
            found = re.search(r"hardware: (.+?)(?:\s{2,}|$)", r.get("plan_summary") or "", re.M)
            preset = found.group(1) if found else None
            if card_of(preset) not in r.get("device_name", ""):
                continue
            rows.append(dict(r, record=path.name, preset=preset, fitted=used_in_fitting(r, preset),
                             error_pct=100 * (r["median_step_s"] / r["predicted_step_s"] - 1)))
    return rows


def first_runs(rows: list[dict]) -> list[dict]:
    """Each prediction judged once: of the rows that ran the same plan (`plan_sha256`), the one measured
    first (`measure_start_utc`); a later run of it (a repeat, or the same plan on later code) is not a
    new held-out point. Rows without a plan's sha256 are each their own."""
    first: dict[str, dict] = {}
    for r in rows:
        key = r.get("plan_sha256") or f"row {id(r)}"
        if key not in first or r.get("measure_start_utc", "") < first[key].get("measure_start_utc", ""):
            first[key] = r
    return [r for r in rows if first.get(r.get("plan_sha256") or f"row {id(r)}") is r]


def registration_records(folder: Path) -> list[tuple[str, dict]]:
    """(file name, record) of each registration record in `folder` (predict_vs_measured/results/*-registered-*.json,
    written by predict_vs_measured/register.py), in name order."""
    return [(path.name, json.loads(path.read_text())) for path in sorted(Path(folder).glob("*-registered-*.json"))]


def registrations(folder: Path) -> dict[str, str]:
    """plan sha256 -> when its prediction was registered (UTC), over the registration records in `folder`
    (predict_vs_measured/results/*-registered-*.json, written by predict_vs_measured/register.py)."""
    out = {}
    for _, record in registration_records(folder):
        for point in record["points"]:
            out[point["plan_sha256"]] = record["registered_utc"]
    return out


def registered_before(row: dict, registered: dict[str, str]) -> bool:
    """Whether a measured point ran a plan whose prediction was registered (and committed) before its run."""
    when = registered.get(row.get("plan_sha256") or "")
    return when is not None and when < row.get("measure_start_utc", "")
