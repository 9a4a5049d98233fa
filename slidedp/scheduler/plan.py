"""The Plan: decisions per layer plus the predictions they lead to. Plain data, JSON round-trip.

Until the CP-SAT scheduler lands, `default_plan` makes the fixed schedule: one chunk per layer,
every block recomputed, double-buffered weights (window 2, or 1 if 2 does not fit the budget).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slidedp.budget import format_bytes
from slidedp.costmodel.hardware import Hardware
from slidedp.costmodel.memory import MemoryBreakdown, device_memory
from slidedp.costmodel.step_time import StepTime, step_time
from slidedp.errors import InfeasibleBudgetError
from slidedp.ir.graph import BLOCK, LayerGraph

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LayerDecision:
    layer_id: int
    name: str
    kind: str
    numel: int
    chunks: int  # the layer's parameters move and update in this many chunks
    activation: str  # "recompute" | "keep" | "resident" (prologue/epilogue)
    delivery: str = "replicated"  # "replicated" | "sharded"
    reduction: str = "cpu"  # "cpu" | "gpu"


@dataclass(frozen=True)
class TimelineEvent:
    """One predicted operation on one lane of one rank (seconds from the step's start)."""

    rank: int
    lane: str  # "compute" | "h2d" | "d2h" | "collective" | "cpu_update"
    name: str  # e.g. "fwd L3", "h2d L3 c1", "update L3 c0"
    layer_id: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class MemoryPoint:
    """Predicted memory from `t_s` on (until the next point)."""

    t_s: float
    device_bytes: int  # per rank
    pinned_host_bytes: int  # all ranks


@dataclass(frozen=True)
class Workload:
    batch_size: int
    seq_len: int
    world_size: int
    precision: str
    micro_batches: int  # micro-batches per rank that share one pass over the weights


@dataclass(frozen=True)
class Plan:
    schema_version: int
    slidedp_version: str
    model_fingerprint: str
    model_class: str
    workload: Workload
    budget_bytes: int
    hardware: dict
    solver: dict
    window: int  # blocks whose weights are resident at once
    decisions: tuple[LayerDecision, ...]
    predicted: dict  # StepTime fields
    memory: dict  # MemoryBreakdown fields
    peak_device_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    timeline: tuple[TimelineEvent, ...] = ()
    memory_timeline: tuple[MemoryPoint, ...] = ()

    @property
    def predicted_step_time_s(self) -> float:
        return float(self.predicted["step_s"])

    def activation_policy(self) -> dict[int, str]:
        return {d.layer_id: d.activation for d in self.decisions}

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"plan schema version {version!r} is not supported (this slidedp reads {SCHEMA_VERSION})")
        data = dict(data)
        data["workload"] = Workload(**data["workload"])
        data["decisions"] = tuple(LayerDecision(**d) for d in data["decisions"])
        data["notes"] = tuple(data.get("notes", ()))
        data["timeline"] = tuple(TimelineEvent(**e) for e in data.get("timeline", ()))
        data["memory_timeline"] = tuple(MemoryPoint(**m) for m in data.get("memory_timeline", ()))
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a plan JSON file ({exc})") from exc
        return cls.from_dict(data)

    # -- presentation -------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | Path) -> None:
        """The predicted timeline as Perfetto / chrome://tracing JSON (see slidedp.report)."""
        from slidedp.report.chrome_trace import to_chrome_trace

        to_chrome_trace(self, path)

    def to_html(self, path: str | Path) -> None:
        """A self-contained HTML report: swimlanes, memory over time, decisions (see slidedp.report)."""
        from slidedp.report.html import to_html

        to_html(self, path)

    def summary(self) -> str:
        p = self.predicted
        w = self.workload
        lines = [
            f"slidedp plan for {self.model_class} (fingerprint {self.model_fingerprint[:12]})",
            f"  workload: {w.world_size} rank(s) x {w.micro_batches} micro-batch(es) x {w.batch_size} x {w.seq_len} "
            f"tokens, {w.precision}",
            f"  hardware: {self.hardware['name']}   budget: {format_bytes(self.budget_bytes)}   "
            f"solver: {self.solver.get('method')}",
            f"  window: {self.window} block(s) resident   peak device memory: {format_bytes(self.peak_device_bytes)}",
            f"  predicted step: {p['step_s'] * 1e3:.1f} ms  (compute {p['compute_s'] * 1e3:.1f}, "
            f"H2D {p['h2d_s'] * 1e3:.1f}, D2H {p['d2h_s'] * 1e3:.1f}, CPU update {p['cpu_update_s'] * 1e3:.1f}, "
            f"exposed {p['exposed_s'] * 1e3:.1f}) — bottleneck: {p['bottleneck']}",
            "",
            f"  {'layers':<28} {'params':>12} {'chunks':>6} {'activation':>10} {'delivery':>10} {'reduction':>9}",
        ]
        for group in _groups(self.decisions):
            first, last = group[0], group[-1]
            label = first.name if len(group) == 1 else f"{first.name} .. {last.name.rsplit('.', 1)[-1]}"
            numel = sum(d.numel for d in group)
            lines.append(
                f"  {label:<28} {numel:>12,} {first.chunks:>6} {first.activation:>10} "
                f"{first.delivery:>10} {first.reduction:>9}"
            )
        lines.append("")
        lines.append("  device memory:")
        for key, value in self.memory.items():
            lines.append(f"    {key:<28} {format_bytes(value):>12}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def _groups(decisions) -> list[list[LayerDecision]]:
    """Consecutive layers of the same kind with identical decisions, for a compact table."""
    groups: list[list[LayerDecision]] = []
    for d in decisions:
        key = (d.kind, d.chunks, d.activation, d.delivery, d.reduction)
        if groups and groups[-1][0].kind == BLOCK and d.kind == BLOCK and key == (
            groups[-1][0].kind, groups[-1][0].chunks, groups[-1][0].activation,
            groups[-1][0].delivery, groups[-1][0].reduction,
        ):
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def default_plan(
    graph: LayerGraph, *, budget_bytes: int, hardware: Hardware, world_size: int, precision: str,
    micro_batches: int, version: str,
) -> Plan:
    """One chunk per layer, every block recomputed, the widest window (2, else 1) that fits."""
    activation = {layer.id: ("recompute" if layer.kind == BLOCK else "resident") for layer in graph.layers}
    memory: MemoryBreakdown | None = None
    for window in (2, 1):
        memory = device_memory(graph, window=window, micro_batches=micro_batches, activation=activation)
        if memory.total_bytes <= budget_bytes:
            break
    else:
        raise InfeasibleBudgetError(
            f"the device budget {format_bytes(budget_bytes)} is below the {format_bytes(memory.total_bytes)} "
            f"the smallest schedule needs ({_largest_terms(memory)})",
            min_budget_bytes=memory.total_bytes,
            budget_bytes=budget_bytes,
        )
    predicted: StepTime = step_time(graph, hardware, window=window, micro_batches=micro_batches,
                                    activation=activation, overlap_updates=False)
    decisions = tuple(
        LayerDecision(layer.id, layer.name, layer.kind, layer.numel, 1, activation[layer.id])
        for layer in graph.layers
    )
    return Plan(
        schema_version=SCHEMA_VERSION,
        slidedp_version=version,
        model_fingerprint=graph.fingerprint(),
        model_class=graph.model_class,
        workload=Workload(graph.batch_size, graph.seq_len, world_size, precision, micro_batches),
        budget_bytes=int(budget_bytes),
        hardware=hardware.to_dict(),
        solver={"method": "default", "status": "FIXED"},
        window=window,
        decisions=decisions,
        predicted=predicted.to_dict(),
        memory=asdict(memory),
        peak_device_bytes=memory.total_bytes,
        notes=("fixed default schedule: one chunk per layer, every block recomputed",),
    )


def _largest_terms(memory: MemoryBreakdown) -> str:
    items = sorted(asdict(memory).items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in items)
