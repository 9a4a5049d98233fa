"""A plan as one self-contained HTML page: header, swimlanes per rank, memory over time, decisions.

Everything is inline (CSS and SVG, no script, no fonts, no links), so the file opens offline. This
module turns the plan into plain geometry (rectangles, paths, ticks, rows of text); the jinja2
template `templates/report.html.j2` only lays it out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

from slidedp.budget import format_bytes
from slidedp.report.tracks import LANES, OP_KINDS, lane_order, lane_title, op_kind, sub_tracks

if TYPE_CHECKING:
    from slidedp.scheduler.plan import LayerDecision, Plan

TEMPLATES = Path(__file__).parent / "templates"

# Colour per op kind (colour-blind-friendly Tableau 10 hues).
KIND_COLOURS: dict[str, str] = {
    "h2d": "#4e79a7", "fwd": "#59a14f", "recompute": "#edc948", "bwd": "#f28e2b",
    "d2h": "#b07aa1", "update": "#9c755f", "collective": "#e15759",
}
# Geometry of the SVG figures, in CSS pixels.
WIDTH = 1160
LABEL_W = 120  # left margin for row labels / memory axis
RIGHT_PAD = 16
ROW_H = 16
ROW_GAP = 3
RANK_HEAD = 20
RANK_GAP = 10
AXIS_H = 24
MEM_H = 220
NO_TIMELINE = ("This plan has no predicted timeline (solver: {solver}). The swimlanes and the memory curve "
               "need a plan whose scheduler records the timeline of each rank and lane; the predicted totals "
               "and the decisions below still apply.")
NO_MEMORY_TIMELINE = "This plan has no predicted memory timeline; the peak and its breakdown are listed above."


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class TimeAxis:
    """Linear map from seconds to x, and its labelled ticks."""

    end_s: float
    x0: float
    x1: float
    ticks: tuple[Tick, ...]

    def x(self, t_s: float) -> float:
        return self.x0 + (self.x1 - self.x0) * (t_s / self.end_s if self.end_s > 0 else 0.0)


def nice_step(span: float, target: int) -> float:
    """The 1-2-5 x 10^k step that cuts `span` into the number of intervals closest to `target`."""
    if span <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(span / max(1, target)))
    candidates = [m * power * scale for scale in (0.1, 1, 10) for m in (1, 2, 5)]
    return min(candidates, key=lambda step: (abs(span / step - target), -step))


def format_time(t_s: float, unit: str | None = None) -> str:
    """Seconds as s / ms / µs with at most 3 significant decimals."""
    unit = unit or ("s" if abs(t_s) >= 1 else "ms" if abs(t_s) >= 1e-3 or t_s == 0 else "µs")
    value = t_s * {"s": 1, "ms": 1e3, "µs": 1e6}[unit]
    return f"{value:.3f}".rstrip("0").rstrip(".") + f" {unit}"


def time_axis(end_s: float, x0: float, x1: float, target: int = 10) -> TimeAxis:
    end_s = end_s if end_s > 0 else 1e-3
    step = nice_step(end_s, target)
    unit = "s" if step >= 0.1 else "ms" if step >= 1e-4 else "µs"
    axis = TimeAxis(end_s, x0, x1, ())
    count = int(end_s / step * (1 + 1e-9)) + 1
    return TimeAxis(end_s, x0, x1, tuple(Tick(round(axis.x(n * step), 2), format_time(n * step, unit))
                                         for n in range(count)))


def swimlanes(plan: "Plan", axis: TimeAxis) -> dict:
    """Rows (rank x lane x sub-track) and one rectangle per operation, sub-tracks as in the trace."""
    sub, track_depth = sub_tracks(plan.timeline)
    depth: dict[str, int] = defaultdict(lambda: 1)  # the same rows for every rank
    for (_, lane), n in track_depth.items():
        depth[lane] = max(depth[lane], n)
    ranks = sorted({e.rank for e in plan.timeline} | set(range(plan.workload.world_size)))
    used = {e.lane for e in plan.timeline}
    hidden = {"collective"} if plan.workload.world_size == 1 and "collective" not in used else set()
    lanes = sorted((set(LANES) - hidden) | used, key=lambda lane: (lane_order(lane), lane))

    rows, groups, row_y = [], [], {}
    y = AXIS_H
    for rank in ranks:
        groups.append({"label": f"rank {rank}", "y": y + RANK_HEAD - 6})
        top = y
        y += RANK_HEAD
        for lane in lanes:
            for k in range(depth[lane]):
                row_y[(rank, lane, k)] = y
                label = lane_title(lane) if k == 0 else f"{lane_title(lane)} ({k + 1})"
                rows.append({"label": label, "y": y, "h": ROW_H, "sub": k > 0})
                y += ROW_H + ROW_GAP
        groups[-1]["top"] = top
        groups[-1]["bottom"] = y
        y += RANK_GAP

    critical = {id(e) for e in plan.explanation.critical_events()}
    rects = []
    for i, e in enumerate(plan.timeline):
        x0, x1 = axis.x(e.start_s), axis.x(e.end_s)
        width = max(x1 - x0, 1.0)
        kind = op_kind(e.lane, e.name)
        short = next((text for text in (e.name, e.name.partition(" ")[2]) if text and len(text) * 6.2 + 4 <= width), "")
        rects.append({
            "x": round(x0, 2), "y": row_y[(e.rank, e.lane, sub[i])], "w": round(width, 2), "h": ROW_H,
            "kind": kind, "text": short, "thin": width < 3, "critical": id(e) in critical,
            "title": (f"{e.name} — rank {e.rank}, {lane_title(e.lane)} — {format_time(e.start_s)} → "
                      f"{format_time(e.end_s)} ({format_time(e.end_s - e.start_s)})"
                      + (" — on the critical path" if id(e) in critical else "")),
        })
    height = y + 4
    step_s = float(plan.predicted.get("step_s", 0.0) or 0.0)
    step_marker = {"x": round(axis.x(step_s), 2), "label": f"predicted step {format_time(step_s)}"} \
        if 0 < step_s <= axis.end_s * (1 + 1e-9) else None
    return {"rows": rows, "groups": groups, "rects": rects, "height": height, "step": step_marker}


def critical_path(plan: "Plan") -> dict | None:
    """The chain of operations that sets the step, as runs of consecutive operations on one lane:
    each run off the compute lane is time the compute lane waits for (it exposes that time)."""
    events = plan.explanation.critical_events()
    if not events:
        return None
    runs: list[list] = []
    for e in events:
        if runs and runs[-1][0].lane == e.lane and runs[-1][0].rank == e.rank:
            runs[-1].append(e)
        else:
            runs.append([e])
    rows = []
    for run in runs:
        first, last = run[0], run[-1]
        rows.append({
            "lane": lane_title(first.lane), "rank": first.rank, "count": len(run),
            "ops": first.name if len(run) == 1 else f"{first.name} .. {last.name}",
            "start": format_time(first.start_s), "time": format_time(last.end_s - first.start_s),
            "exposed": first.lane != "compute",
        })
    lanes = [(lane_title(lane), format_time(t)) for lane, t in plan.explanation.critical_lanes_s().items()]
    return {"count": len(events), "lanes": lanes, "runs": rows,
            "exposed": format_time(sum(e.end_s - e.start_s for e in events if e.lane != "compute"))}


def memory_chart(plan: "Plan", axis: TimeAxis) -> dict:
    """Device memory per rank as a step curve from `memory_timeline`, with the budget as a line."""
    points = sorted(plan.memory_timeline, key=lambda p: p.t_s)
    peak = max([p.device_bytes for p in points] + [plan.peak_device_bytes])
    top_bytes = max(plan.budget_bytes, peak) * 1.1
    plot_top, plot_bottom = 14, MEM_H - AXIS_H

    def y(b: float) -> float:
        return round(plot_bottom - (plot_bottom - plot_top) * b / top_bytes, 2)

    path = []  # a step curve: each value holds until the next point, the last one to the end
    for i, p in enumerate(points):
        x = round(axis.x(p.t_s), 2)
        path.append(f"M{x} {y(p.device_bytes)}" if i == 0 else f"H{x} V{y(p.device_bytes)}")
    path.append(f"H{round(axis.x1, 2)}")
    area = " ".join(path) + f" V{plot_bottom} H{round(axis.x(points[0].t_s), 2)} Z"
    unit, scale = next((u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if top_bytes >= 2 * b or b == 1)
    step = nice_step(top_bytes / scale, 5)
    yticks = [{"y": y(k * step * scale), "label": f"{k * step:g} {unit}"}
              for k in range(int(top_bytes / scale // step) + 1)]
    curve_peak = max((p.device_bytes for p in points), default=0)
    peak_point = next((p for p in points if p.device_bytes == curve_peak), None)
    return {
        "path": " ".join(path), "area": area, "height": MEM_H, "plot_top": plot_top, "plot_bottom": plot_bottom,
        "yticks": yticks, "budget_y": y(plan.budget_bytes), "budget_label": f"budget {format_bytes(plan.budget_bytes)}",
        "peak": None if peak_point is None else {
            "x": round(axis.x(peak_point.t_s), 2), "y": y(curve_peak),
            "label": f"peak {format_bytes(curve_peak)} at {format_time(peak_point.t_s)}"},
        "points": [{"x": round(axis.x(p.t_s), 2), "y": y(p.device_bytes),
                    "title": f"{format_time(p.t_s)}: device {format_bytes(p.device_bytes)}, "
                             f"pinned host {format_bytes(p.pinned_host_bytes)}"} for p in points],
    }


def group_decisions(decisions: "tuple[LayerDecision, ...]", device_state=(), streamed=()) -> list[dict]:
    """Consecutive layers of one kind with identical decisions (where their optimizer state lives
    and updates included), as one table row each."""
    where = {i: "device" for i in device_state} | {i: "streamed" for i in streamed}
    groups: list[list] = []
    for d in decisions:
        key = (*_key(d), where.get(d.layer_id, "host"))
        if groups and key == (*_key(groups[-1][0]), where.get(groups[-1][0].layer_id, "host")):
            groups[-1].append(d)
        else:
            groups.append([d])
    rows = []
    for group in groups:
        first, last = group[0], group[-1]
        label = first.name if len(group) == 1 else f"{first.name} .. {last.name.rsplit('.', 1)[-1]}"
        rows.append({
            "label": label, "ids": f"{first.layer_id}" if len(group) == 1 else f"{first.layer_id}–{last.layer_id}",
            "count": len(group), "kind": first.kind, "params": f"{sum(d.numel for d in group):,}",
            "chunks": first.chunks, "activation": first.activation, "delivery": first.delivery,
            "reduction": first.reduction, "optimizer": OPTIMIZER_WHERE[where.get(first.layer_id, "host")],
        })
    return rows


OPTIMIZER_WHERE = {"host": "host (CPU AdamW)", "device": "device-resident",
                   "streamed": "streamed (updated on the device)"}
# solver entries whose values are seconds though their keys do not say so
_SECONDS = ("candidates", "streamed_tried")


def _key(d) -> tuple:
    return (d.kind, d.chunks, d.activation, d.delivery, d.reduction)


def _value(key: str, value) -> str:
    """A predicted or solver value for display: seconds in ms/s, numbers compact, the rest as text."""
    if isinstance(value, dict):
        hint = "_s" if key in _SECONDS else ""
        return ", ".join(f"{k}: {_value(k if not hint else k + hint, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "; ".join(_value(key, v) for v in value)
    if isinstance(value, float) and key in ("relative_gap",):
        return f"{100 * value:.2f}%"
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_s"):
        return format_time(float(value))
    if key.endswith("_bytes"):
        return format_bytes(int(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}"


def _gap(key: str, value) -> str:
    """A solver gap: relative gaps as a percentage, others as they come, named by their key."""
    if "rel" in key.lower() and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{100 * value:.2f}% ({key})"
    return f"{_value(key, value)} ({key})"


def header(plan: "Plan") -> dict:
    w = plan.workload
    hw = plan.hardware
    predicted = [{"key": k.removesuffix("_s"), "value": _value(k, v), "bottleneck": k == f"{plan.predicted.get('bottleneck')}_s"}
                 for k, v in plan.predicted.items() if k not in ("step_s", "bottleneck")]
    solver = dict(plan.solver)
    gap_keys = [k for k in solver if "gap" in k.lower()]
    hardware = [("GPU memory", format_bytes(int(hw["gpu_memory_bytes"]))) if "gpu_memory_bytes" in hw else None,
                ("matmul", f"{hw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s") if "matmul_flops_per_s" in hw else None,
                ("H2D / D2H", f"{hw['h2d_bytes_per_s'] / 1e9:.0f} / {hw['d2h_bytes_per_s'] / 1e9:.0f} GB/s")
                if "h2d_bytes_per_s" in hw and "d2h_bytes_per_s" in hw else None,
                ("CPU AdamW", f"{hw['cpu_adamw_params_per_s'] / 1e9:.2f} G params/s")
                if "cpu_adamw_params_per_s" in hw else None,
                ("GPU P2P", f"{hw['gpu_p2p_bytes_per_s'] / 1e9:.0f} GB/s" if hw.get("gpu_p2p_bytes_per_s") else "none")
                if "gpu_p2p_bytes_per_s" in hw else None]
    return {
        "title": f"slidedp plan — {plan.model_class}",
        "fingerprint": plan.model_fingerprint[:12],
        "version": plan.slidedp_version,
        "workload": (f"{w.world_size} rank(s) × {w.micro_batches} micro-batch(es) × {w.batch_size} × "
                     f"{w.seq_len} tokens, {w.precision}"),
        "tokens": f"{w.world_size * w.micro_batches * w.batch_size * w.seq_len:,}",
        "hardware_name": hw.get("name", "?"),
        "hardware": [h for h in hardware if h is not None],
        "budget": format_bytes(plan.budget_bytes),
        "peak": format_bytes(plan.peak_device_bytes),
        "peak_pct": f"{100 * plan.peak_device_bytes / plan.budget_bytes:.0f}%" if plan.budget_bytes else "?",
        "window": plan.window,
        "step": format_time(float(plan.predicted.get("step_s", 0.0))),
        "bottleneck": plan.predicted.get("bottleneck", "?"),
        "predicted": predicted,
        "solver_method": solver.pop("method", "?"),
        "solver_status": solver.pop("status", "?"),
        "solver_gap": ", ".join(_gap(k, solver[k]) for k in gap_keys) or "n/a",
        "solver_rest": [(k, _value(k, v)) for k, v in sorted(solver.items()) if k not in gap_keys],
        "memory": [{"key": k, "value": format_bytes(int(v)),
                    "pct": f"{100 * v / plan.budget_bytes:.1f}%" if plan.budget_bytes else ""}
                   for k, v in plan.memory.items()],
    }


def render_html(plan: "Plan") -> str:
    """The report as one HTML string."""
    end_s = max([e.end_s for e in plan.timeline] + [p.t_s for p in plan.memory_timeline] + [0.0])
    if plan.timeline:
        end_s = max(end_s, float(plan.predicted.get("step_s", 0.0) or 0.0))
    axis = time_axis(end_s, LABEL_W, WIDTH - RIGHT_PAD)
    used_kinds = {op_kind(e.lane, e.name) for e in plan.timeline}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2").render(
        h=header(plan),
        axis=axis,
        width=WIDTH,
        label_w=LABEL_W,
        lanes=swimlanes(plan, axis) if plan.timeline else None,
        critical=critical_path(plan),
        no_timeline=NO_TIMELINE.format(solver=f"{plan.solver.get('method', '?')}, {plan.solver.get('status', '?')}"),
        memory=memory_chart(plan, axis) if plan.memory_timeline else None,
        no_memory_timeline=NO_MEMORY_TIMELINE,
        colours=list(KIND_COLOURS.items()),
        kinds=[(k, KIND_COLOURS[k]) for k in OP_KINDS if k in used_kinds],
        decisions=group_decisions(plan.decisions, plan.device_state, plan.streamed_updates),
        alternatives=[{"decision": a.decision, "chosen": a.chosen, "runner_up": a.runner_up,
                       "chosen_step": format_time(a.chosen_step_s),
                       "runner_up_step": "does not fit" if a.runner_up_step_s is None
                       else format_time(a.runner_up_step_s),
                       "reason": a.reason} for a in plan.alternatives],
        notes=plan.notes,
    )


def to_html(plan: "Plan", path: str | Path) -> None:
    """Write the self-contained HTML report of `plan` to `path`."""
    Path(path).write_text(render_html(plan), encoding="utf-8")
