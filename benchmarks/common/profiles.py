"""Hardware profiles derived from a machine's profile and a measurement made beside it (or a what-if),
named so.

`with_adamw_beside_copies(profile, record)`: the profile with the CPU AdamW's share of its rate beside copies
both ways (`cpu_adamw_contended_fraction`) that a `benchmarks/cpu_adamw/in_step.py` record measured in
`slidedp calibrate`'s setting: what calibrate measures since its copies run throughout the timing, for
profiles calibrated before that (their 0.93) or given the H200's step fit (0.78).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from slidedp.costmodel.hardware import HOST_FIELDS, Hardware, resolve_hardware, with_host


def calibrate_fraction(record: dict) -> float:
    """The fraction of its rate the AdamW keeps beside copies both ways in calibrate's setting (NumPy
    arrays, every core): `slidedp calibrate`'s own measurement where the record has it, else the rows
    that reproduce it."""
    own = [r["fraction"] for r in record["rows"] if r.get("field") == "cpu_adamw_contended_fraction"]
    if own:
        return own[0]
    cores = record["cores"]
    rate = {r["condition"]: r["params_per_s"] for r in record["rows"]}
    return (rate[f"NumPy arrays, {cores} threads, copies both ways (as calibrate)"]
            / rate[f"NumPy arrays, {cores} threads (as calibrate)"])


def with_adamw_beside_copies(hardware: Hardware | str, record_path: str | Path) -> Hardware:
    """`hardware` (a profile, or a preset name or profile path) with the fraction `record_path` measured
    (`calibrate_fraction`); its name says the fraction and the record."""
    hw = resolve_hardware(hardware, "cpu") if isinstance(hardware, str) else hardware
    fraction = calibrate_fraction(json.loads(Path(record_path).read_text()))
    return replace(hw, cpu_adamw_contended_fraction=fraction,
                   name=f"{hw.name}, AdamW beside copies {fraction:.3f} ({Path(record_path).name})")


def with_compiled_host_floor(hardware: Hardware, fwd_s: float, bwd_s: float) -> Hardware:
    """`hardware` with a compiled block's host floor of `fwd_s` / `bwd_s` a micro-batch (what `slidedp
    calibrate` measures now; a what-if for profiles made before it); its name says so."""
    return replace(hardware, host_compiled_fwd_s=fwd_s, host_compiled_bwd_s=bwd_s,
                   name=f"{hardware.name}, compiled host floor {fwd_s * 1e3:g} / {bwd_s * 1e3:g} ms (what-if)")


def host_prediction(plan, graph, host_profile: str | Path) -> dict:
    """The record fields of a plan's step predicted again with the host fields of `host_profile` (`slidedp
    calibrate --host-only`, run by the same benchmark invocation before the point): the plan's own hardware with this
    host's CPU AdamW, DRAM and block-issue times, replayed (scheduler/replay.py)."""
    from slidedp.scheduler.replay import replay

    host = Hardware.load(host_profile)
    hardware = with_host(Hardware.from_dict(plan.hardware), host)
    return {"host_predicted_step_s": replay(plan, graph, hardware).step_s, "host_profile": str(host_profile),
            "host_fields": {f: getattr(host, f) for f in HOST_FIELDS}}
