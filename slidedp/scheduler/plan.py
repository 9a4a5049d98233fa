"""The Plan: plain data, JSON round-trip; it knows no solver and no renderer.

A plan has two parts. `Plan.schedule` (a `Schedule`) is the contract: what the backend lowers
and the executor must honour, and all it reads. `Plan.explanation` (an `Explanation`) says why and
what to expect: the predicted step and memory, the timeline, per-group predictions, each decision
against its runner-up, and which search made the decisions. The schedule:

  window                  weight slots
  window_loads            the blocks' weight loads, in order: which block into which slot, and after
                          which block visit the copy may start (Belady eviction, scheduler/problem/lanes.py)
  decisions[i].chunks     layer i's H2D, D2H and CPU update move in this many equal chunks
  decisions[i].activation recompute | keep (saved tensors stay on the device until the backward)
                          | offload (copied to pinned host after the forward, back before the
                          backward) | recompute_offload (recompute, the block's input copied to
                          pinned host after the forward, back before the backward)
                          | resident (prologue, epilogue)
  decisions[i].delivery / reduction, owners: routes, and the rank updating each chunk
  update_order            layer ids in the order the CPU updates them after the step boundary; the
                          next step's load of a layer waits for its update
  device_state            layer ids whose fp32 master weights and AdamW moments live on the
                          device (the same on every rank): loaded once, updated there after the
                          step's norm, their weights copied into the slots within the device, their
                          gradient all-reduced between the devices (the CPU skips them)
  device_state_sharded    several ranks: each keeps the device state only of the chunks it owns
                          (decisions[i].owners); the gradient is reduce-scattered onto the owners,
                          each updates its chunks, and every load all-gathers the owners' weights
  early_order             host layers the CPU updates during the backward, as each gradient lands
                          (one rank, no clipping; backend/runtime/early_updates.py)
  early_in_place          the early updates write over the state they read (a non-finite gradient
                          stops training: nonfinite="stop"), with no spare state; else out of place
  streamed_gradients      every host layer's gradient updates it as it lands, in place, from the
                          staging buffer (no gradient in host RAM; early_order is the landing order)
  streamed_updates        host layers the devices update at the step boundary, their fp32 state
                          streamed up and back down (backend/runtime/streamed_updates.py)
  loss_chunk_tokens       the epilogue computes the loss over this many tokens at a time
  vocab_chunk_rows        a prologue / epilogue whose activation is "streamed" moves its vocabulary
                          table ([vocab, hidden]) this many rows at a time (docs/design.md §4.14)
Plans are made by `slidedp.scheduler.solve`; `Plan.workload.micro_batches` micro-batches per rank
share one pass over the weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from slidedp.budget import format_bytes
from slidedp.ir.graph import BLOCK, EPILOGUE, PROLOGUE

SCHEMA_VERSION = 3
# A block's activation policies (scheduler/decisions.py names them); offload and recompute_offload copy
# to pinned host memory after the forward and back before the backward.
BLOCK_ACTIVATIONS = ("recompute", "keep", "offload", "recompute_offload")
RECOMPUTED_ACTIVATIONS = ("recompute", "recompute_offload")  # the backward recomputes the forward


def input_offloaded(activation: dict, block_id: int) -> bool:
    """Whether a block's input leaves the device between its forward and backward (`activation`: the
    policy by block id): it is recompute_offload and no graph holds its input, the output of the
    block before it (a recomputed block keeps none; a kept or offloaded one holds its output as the
    root of its backward, and the prologue holds block 1's input). Otherwise it stays, as recompute's."""
    return activation.get(block_id) == "recompute_offload" and activation.get(block_id - 1) in RECOMPUTED_ACTIVATIONS


def host_activation_bytes(layer, policy: str) -> int:
    """Host bytes per micro-batch a block's policy offloads: what its forward saves (offload), its input
    (recompute_offload: the boundary activation), none otherwise."""
    return {"offload": layer.costs.saved_activation_bytes,
            "recompute_offload": layer.costs.boundary_activation_bytes}.get(policy, 0)


@dataclass(frozen=True)
class Load:
    """One weight load of the window: block `block` into slot `slot`, needed at block visit
    `position` (0..2N-1: forward, then backward), issued once visit `issue_after` has computed."""

    position: int
    block: int
    slot: int
    issue_after: int  # -1: at once


@dataclass(frozen=True)
class LayerDecision:
    layer_id: int
    name: str
    kind: str
    numel: int
    chunks: int  # the layer's parameters move and update in this many chunks
    activation: str  # BLOCK_ACTIVATIONS; "resident" | "streamed" (prologue/epilogue)
    delivery: str = "replicated"  # "replicated" | "sharded"
    reduction: str = "cpu"  # "cpu" | "gpu"
    owners: tuple[int, ...] = ()  # rank whose CPU threads update each chunk (() : rank 0)
    # the delivery copy (weights in the compute dtype) kept in host RAM, or made on load from the
    # fp32 master (H2D of 4 B per parameter, cast on the device): "kept" | "on_load"
    host_copy: str = "kept"


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
    compiled_blocks: bool = False  # blocks run through torch.compile (backend/runtime/executor.py)
    hosts: int = 1  # the hosts the ranks span, world_size / hosts ranks each
    link_bytes_per_s: float = 0.0  # each host's rate into the network between hosts (hosts > 1)


@dataclass(frozen=True)
class GroupPrediction:
    """Predicted work of a group of consecutive layers with the same decisions (rank 0, one step)."""

    label: str
    layer_ids: tuple[int, ...]
    h2d_bytes: int  # weights and activations copied up, per rank
    d2h_bytes: int  # gradients and activations copied down, per rank
    collective_bytes: int  # all-gather + reduce-scatter payload, per rank
    host_dram_bytes: int  # host memory traffic of delivery and reduction, all ranks
    compute_s: float
    h2d_s: float
    d2h_s: float
    collective_s: float
    cpu_update_s: float
    exposed_s: float  # time the compute lane waits before this group's compute ops
    bottleneck: str  # the lane this group keeps busiest


@dataclass(frozen=True)
class Alternative:
    """A decision of the plan against its runner-up, both simulated (None: does not fit)."""

    decision: str  # e.g. "activation of blocks 1-40"
    chosen: str
    runner_up: str
    chosen_step_s: float
    runner_up_step_s: float | None
    runner_up_peak_bytes: int
    reason: str


@dataclass(frozen=True)
class Schedule:
    """What the executor must honour (the module docstring says what each field means)."""

    window: int
    decisions: tuple[LayerDecision, ...]
    window_loads: tuple[Load, ...]
    update_order: tuple[int, ...] = ()  # () : prologue, blocks, epilogue
    device_state: tuple[int, ...] = ()
    early_order: tuple[int, ...] = ()
    streamed_updates: tuple[int, ...] = ()
    loss_chunk_tokens: int = 0  # 0 : the whole micro-batch at once
    streamed_gradients: bool = False  # every host layer's gradient applied as it lands (no host gradient)
    vocab_chunk_rows: int = 0  # rows per chunk of a streamed vocabulary table (0: none streamed)
    device_state_sharded: bool = False
    early_in_place: bool = False  # the early updates in place (no spare state), nonfinite="stop"

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        return cls(
            window=data["window"],
            decisions=tuple(LayerDecision(**{**d, "owners": tuple(d.get("owners", ()))}) for d in data["decisions"]),
            window_loads=tuple(Load(*row) for row in data["window_loads"]),
            **{k: tuple(data.get(k, ())) for k in ("update_order", "device_state", "early_order", "streamed_updates")},
            loss_chunk_tokens=data.get("loss_chunk_tokens", 0),
            vocab_chunk_rows=data.get("vocab_chunk_rows", 0),
            device_state_sharded=data.get("device_state_sharded", False),
            streamed_gradients=data.get("streamed_gradients", False),
            early_in_place=data.get("early_in_place", False),
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["window_loads"] = [[ld.position, ld.block, ld.slot, ld.issue_after] for ld in self.window_loads]
        return data


@dataclass(frozen=True)
class Explanation:
    """Why the schedule, and what it is predicted to do; the executor reads none of it.

    `solver["chosen_by"]` names the search whose decisions the plan holds (CP-SAT, a local search,
    a baseline rule, a search around CP-SAT) and `solver["searches"]` every search that decided part
    of them."""

    solver: dict
    predicted: dict  # step_s, compute_s, h2d_s, d2h_s, collective_s, cpu_update_s, exposed_s, bottleneck
    memory: dict  # device bytes at the peak, by buffer (scheduler.problem.footprint.CATEGORIES)
    peak_device_bytes: int
    notes: tuple[str, ...] = ()
    timeline: tuple[TimelineEvent, ...] = ()
    memory_timeline: tuple[MemoryPoint, ...] = ()
    groups: tuple[GroupPrediction, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    # timeline event names, in order: the chain of ops that sets the step (each starts as the one
    # before it ends; their durations add up to the predicted step, scheduler/oracles/critical_path.py)
    critical_path: tuple[str, ...] = ()
    # host RAM of the plan, all ranks of one host (costmodel.memory.host_memory; 0 and {}: not known):
    # the host state ("state": fp32 master, moments, delivery copy, gradient, page-aligned, lean for
    # the layers whose optimizer state a one-rank engine keeps on the device: nothing of them; with
    # several hosts the chunks one host's ranks own, of the host holding the most), early updates'
    # spare state ("spare"), offloaded activations ("offloaded_activations", pinned), the pinned
    # gradient staging ("pinned_buffers") and the bounded staging of those device layers' state
    # ("load_staging"); peak_host_bytes is their sum, held the whole step
    peak_host_bytes: int = 0
    host_memory: dict = field(default_factory=dict)

    def critical_events(self) -> tuple[TimelineEvent, ...]:
        """The timeline events of `critical_path`: for each name in turn, the earliest event of that
        name starting once the one before has ended (ranks run in lockstep: the lowest rank's)."""
        by_name: dict[str, list[TimelineEvent]] = {}
        for e in sorted(self.timeline, key=lambda e: (e.start_s, e.rank)):
            by_name.setdefault(e.name, []).append(e)
        out, after_s = [], 0.0
        for name in self.critical_path:
            e = next((e for e in by_name.get(name, ()) if e.start_s >= after_s * (1 - 1e-9) - 1e-12), None)
            if e is None:
                return ()  # a path that does not fit this timeline: nothing to show
            out.append(e)
            after_s = e.end_s
        return tuple(out)

    def critical_lanes_s(self) -> dict[str, float]:
        """Seconds of the critical path on each lane, in the order the path first reaches them."""
        out: dict[str, float] = {}
        for e in self.critical_events():
            out[e.lane] = out.get(e.lane, 0.0) + (e.end_s - e.start_s)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Explanation":
        tl = data.get("timeline") or {"lanes": [], "events": []}
        return cls(
            solver=data["solver"], predicted=data["predicted"], memory=data["memory"],
            peak_device_bytes=data["peak_device_bytes"], notes=tuple(data.get("notes", ())),
            timeline=tuple(TimelineEvent(rank, tl["lanes"][lane], name, layer, chunk, start, end)
                           for rank, lane, name, layer, chunk, start, end in tl["events"]),
            memory_timeline=tuple(MemoryPoint(*row) for row in data.get("memory_timeline", ())),
            groups=tuple(GroupPrediction(**{**g, "layer_ids": tuple(g["layer_ids"])}) for g in data.get("groups", ())),
            alternatives=tuple(Alternative(**a) for a in data.get("alternatives", ())),
            critical_path=tuple(data.get("critical_path", ())),
            peak_host_bytes=data.get("peak_host_bytes", 0), host_memory=dict(data.get("host_memory") or {}),
        )

    def to_dict(self) -> dict:
        """Timeline and memory curve as rows (one event is 7 values, not a 7-key object)."""
        data = asdict(self)
        lanes = sorted({e.lane for e in self.timeline})
        data["timeline"] = {"lanes": lanes, "events": [
            [e.rank, lanes.index(e.lane), e.name, e.layer_id, e.chunk, e.start_s, e.end_s] for e in self.timeline]}
        data["memory_timeline"] = [[m.t_s, m.device_bytes, m.pinned_host_bytes] for m in self.memory_timeline]
        return data


_SCHEDULE_FIELDS = frozenset(f.name for f in fields(Schedule))
_EXPLANATION_FIELDS = frozenset(f.name for f in fields(Explanation))


@dataclass(frozen=True)
class Plan:
    """A schedule for one model, workload and budget, and its explanation.

    The fields of both parts read as the plan's own (`plan.window`, `plan.predicted`), and
    `plan.replace(window=2, notes=())` returns a copy with fields of either part replaced."""

    schema_version: int
    slidedp_version: str
    model_fingerprint: str
    model_class: str
    workload: Workload
    budget_bytes: int
    hardware: dict
    schedule: Schedule
    explanation: Explanation

    def __getattr__(self, name: str):
        # only called for names that are not the plan's own fields
        if name in _SCHEDULE_FIELDS:
            return getattr(self.schedule, name)
        if name in _EXPLANATION_FIELDS:
            return getattr(self.explanation, name)
        raise AttributeError(f"'Plan' object has no attribute {name!r}")

    def replace(self, **changes) -> "Plan":
        sched = {k: v for k, v in changes.items() if k in _SCHEDULE_FIELDS}
        expl = {k: v for k, v in changes.items() if k in _EXPLANATION_FIELDS}
        own = {k: v for k, v in changes.items() if k not in sched and k not in expl}
        return replace(self, schedule=replace(self.schedule, **sched), explanation=replace(self.explanation, **expl),
                       **own)

    @property
    def predicted_step_time_s(self) -> float:
        return float(self.predicted["step_s"])

    def activation_policy(self) -> dict[int, str]:
        return {d.layer_id: d.activation for d in self.decisions}

    def copies_made_on_load(self) -> tuple[int, ...]:
        """Layer ids whose delivery copy is made on load (LayerDecision.host_copy)."""
        return tuple(d.layer_id for d in self.decisions if d.host_copy == "on_load")

    def spare_layers(self) -> tuple[int, ...]:
        """Layer ids with a spare master and moments in the host state: those the early updates write out
        of place (none where the gradients stream into the update or the early updates are in place)."""
        return () if self.streamed_gradients or self.early_in_place else tuple(self.early_order)

    def streamed_gradient_layers(self) -> tuple[int, ...]:
        """Layer ids whose gradient streams into their update (streamed_gradients: every host layer)."""
        return tuple(self.early_order) if self.streamed_gradients else ()

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self, explanation: bool = True) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("schedule", "explanation")}
        data["workload"] = asdict(self.workload)
        data["schedule"] = self.schedule.to_dict()
        if explanation:
            data["explanation"] = self.explanation.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "the plan") -> "Plan":
        """The plan of a JSON object; anything else (a number, a list, missing or misshapen keys) is
        refused as "not a plan", naming `where`. The values are checked by `validate`."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a plan (a plan is a JSON object, got {type(data).__name__})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"{where}: plan schema version {version!r} is not supported "
                             f"(this slidedp reads {SCHEMA_VERSION})")
        missing = [f.name for f in fields(cls) if f.name not in data and f.name != "explanation"]
        if missing:
            raise ValueError(f"{where}: not a plan (missing key(s) {', '.join(map(repr, missing))})")
        data = dict(data)
        key = "workload"
        try:
            data["workload"] = Workload(**data["workload"])
            key = "schedule"
            data["schedule"] = Schedule.from_dict(data["schedule"])
            key = "explanation"
            data["explanation"] = Explanation.from_dict(data["explanation"]) if "explanation" in data else \
                Explanation(solver={"method": "unknown", "chosen_by": "unknown"}, predicted={}, memory={},
                            peak_device_bytes=0, notes=("saved without its explanation: schedule only",))
            key = "the plan's keys"
            return cls(**data)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            what = f"missing key {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else \
                " ".join(str(exc).split())
            raise ValueError(f"{where}: not a plan ({key}: {what})") from None

    def save(self, path: str | Path, explanation: bool = True) -> None:
        """JSON; `explanation=False` writes the schedule alone (what `compile(plan=)` needs)."""
        Path(path).write_text(json.dumps(self.to_dict(explanation), indent=1))  # key order kept: identical round trips

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan of a JSON file; not UTF-8, not JSON, or not the shape of a plan: ValueError
        naming the file. Its values are not checked here (`validate`; compile checks them)."""
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a plan JSON file (not UTF-8 at byte {exc.start})") from None
        except RecursionError:
            raise ValueError(f"{path}: not a plan JSON file (nested too deeply)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a plan JSON file ({exc})") from None
        return cls.from_dict(data, where=str(path))

    # -- self-consistency ---------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> None:
        """Refuse a plan whose own fields do not hold together, naming the field (ValueError): what
        can be checked without the model. `world_size`: the run's, else the plan's workload's.
        api.check_plan_matches adds what needs the model (layer ids, names, kinds, numel)."""
        problems = self.problems(world_size)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"the plan is not valid: {problems[0]}{more}")

    def problems(self, world_size: int | None = None) -> list[str]:
        """What `validate` would refuse, one line each, "field: what is wrong" (empty: valid)."""
        out: list[str] = []
        try:
            _check_plan(self, world_size, out)
        except _Stop:
            pass
        return out

    # -- presentation (text only; HTML and traces: slidedp.report) ---------------------------
    def summary(self) -> str:
        """Decisions and predictions per layer group, and why each decision beat its runner-up."""
        p, w, sv = self.predicted, self.workload, self.solver
        gap = sv.get("relative_gap")
        solver = f"{sv.get('method')} {sv.get('status', '')}".strip()
        if gap is not None:
            solver += f", gap {gap:.2%}"
        if "wall_s" in sv:
            solver += f", {sv['wall_s']:.1f} s"
        if sv.get("chosen_by") not in (None, "cp-sat"):
            solver += f", plan from {sv['chosen_by']}"
        decided = [f"  decided by: {what}: {how}" for what, how in sv.get("searches", {}).items()]
        inputs_offloaded = [d.layer_id for d in self.decisions if d.activation == "recompute_offload"]
        order = "prologue, epilogue, blocks" if self.update_order[1:2] == (len(self.decisions) - 1,) \
            else "prologue, blocks, epilogue"
        lines = [
            f"slidedp plan for {self.model_class} (fingerprint {self.model_fingerprint[:12]})",
            f"  workload: {w.world_size} rank(s) x {w.micro_batches} micro-batch(es) x {w.batch_size} x {w.seq_len} "
            f"tokens, {w.precision}" + (", blocks compiled" if w.compiled_blocks else "")
            + (f", over {w.hosts} hosts of {w.world_size // w.hosts} (link {w.link_bytes_per_s / 1e9:.1f} GB/s per host)"
               if w.hosts > 1 else ""),
            f"  hardware: {self.hardware['name']}   budget: {format_bytes(self.budget_bytes)}   solver: {solver}",
            *([f"  solver's bound: {sv['gap_explained']}"] if sv.get("gap_explained") else []),
            f"  window: {self.window} block(s) resident   peak device memory: {format_bytes(self.peak_device_bytes)}"
            + (f"   loss chunk: {self.loss_chunk_tokens} tokens" if self.loss_chunk_tokens else ""),
            *([_host_line(self)] if self.peak_host_bytes else []),
            (f"  streamed gradients: each host layer updated in place as its gradient lands ({len(self.early_order)} "
             "layers; no gradient in host RAM; no clipping, a non-finite gradient stops training)"
             if self.streamed_gradients else
             f"  early updates: during the backward, as each gradient lands ({len(self.early_order)} host layers; "
             "no clipping, one rank" + ("; in place, a non-finite gradient stops training)" if self.early_in_place
                                        else _out_of_place(self))
             if self.early_order else f"  update order after the step boundary: {order}"),
            *([_device_state_line(self)] if self.device_state else []),
            *([f"  streamed updates: {_blocks_label(self.decisions, self.streamed_updates)} updated on the device at "
               "the step boundary (fp32 state streamed up and down)"] if self.streamed_updates else []),
            *([_copies_line(self)] if any(d.host_copy == "on_load" for d in self.decisions) else []),
            *([f"  block inputs offloaded: {_blocks_label(self.decisions, inputs_offloaded)} recompute, their input "
               "copied to pinned host memory after the forward and back before the backward"]
              if inputs_offloaded else []),
            *([f"  streamed vocabulary: {', '.join(d.name for d in self.decisions if d.activation == 'streamed')} "
               f"({self.vocab_chunk_rows} rows at a time; not resident)"]
              if any(d.activation == "streamed" for d in self.decisions) else []),
            *decided,
            (f"  predicted step: {p['step_s'] * 1e3:.1f} ms  (busy: compute {p['compute_s'] * 1e3:.1f}, "
             f"H2D {p['h2d_s'] * 1e3:.1f}, D2H {p['d2h_s'] * 1e3:.1f}, collective {p.get('collective_s', 0) * 1e3:.1f}, "
             f"CPU update {p['cpu_update_s'] * 1e3:.1f}; exposed beyond the bottleneck {p['exposed_s'] * 1e3:.1f}) "
             f"— bottleneck: {p['bottleneck']}") if p else "  predicted step: not known (saved without its explanation)",
            *([_critical_line(self.explanation)] if self.explanation.critical_events() else []),
            "",
        ]
        if self.groups:
            by_id = {d.layer_id: d for d in self.decisions}
            lines.append(f"  {'layers':<26} {'params':>13} {'chunks':>6} {'activation':>17} {'route':>16} "
                         f"{'H2D':>9} {'D2H':>9} {'coll':>9} {'compute':>9} {'h2d':>8} {'d2h':>8} {'cpu':>8} "
                         f"{'exposed':>8}  bottleneck")
            for g in self.groups:
                d = by_id[g.layer_ids[0]]
                numel = sum(by_id[i].numel for i in g.layer_ids)
                lines.append(
                    f"  {g.label:<26} {numel:>13,} {d.chunks:>6} {d.activation:>17} "
                    f"{d.delivery + '/' + d.reduction:>16} {_short_bytes(g.h2d_bytes):>9} "
                    f"{_short_bytes(g.d2h_bytes):>9} {_short_bytes(g.collective_bytes):>9} {_ms(g.compute_s):>9} "
                    f"{_ms(g.h2d_s):>8} {_ms(g.d2h_s):>8} {_ms(g.cpu_update_s):>8} {_ms(g.exposed_s):>8}  "
                    f"{g.bottleneck}")
            lines.append("  (bytes moved per rank per step; times busy per lane on rank 0, ms)")
        else:
            lines.append(f"  {'layers':<28} {'params':>12} {'chunks':>6} {'activation':>17} {'delivery':>10} "
                         f"{'reduction':>9}")
            for group in _groups(self.decisions):
                first, last = group[0], group[-1]
                label = first.name if len(group) == 1 else f"{first.name} .. {last.name.rsplit('.', 1)[-1]}"
                numel = sum(d.numel for d in group)
                lines.append(f"  {label:<28} {numel:>12,} {first.chunks:>6} {first.activation:>17} "
                             f"{first.delivery:>10} {first.reduction:>9}")
        if self.alternatives:
            lines += ["", "  why these decisions (each against its runner-up, everything else unchanged):"]
            for a in self.alternatives:
                lines.append(f"    {a.decision}: {a.reason}")
        lines += ["", "  device memory at the peak:"]
        for key, value in self.memory.items():
            if value:
                lines.append(f"    {key:<28} {format_bytes(value):>12}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def _critical_line(explanation: Explanation) -> str:
    """"critical path: N ops, compute X ms, h2d Y ms, ...": where the step's time goes along it."""
    lanes = ", ".join(f"{lane} {_ms(s)} ms" for lane, s in explanation.critical_lanes_s().items())
    wait_s = explanation.critical_events()[0].start_s  # early updates: a load waits for a carried-over update
    if wait_s > 0:
        lanes += f", waiting for the previous step's updates {_ms(wait_s)} ms"
    return f"  critical path: {len(explanation.critical_path)} ops, {lanes}: the lanes that set the step"


def _blocks_label(decisions, layer_ids) -> str:
    """"prologue, epilogue, model.layers.0 .. 16 (17 blocks)" for the decisions of `layer_ids`."""
    names = [d.name for d in decisions if d.layer_id in set(layer_ids) and d.kind == "block"]
    parts = [d.name for d in decisions if d.layer_id in set(layer_ids) and d.kind != "block"]
    if names:
        first, last = names[0], names[-1].rsplit(".", 1)[-1]
        parts.append((first if len(names) == 1 else f"{first} .. {last}") + f" ({len(names)} blocks)")
    return ", ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _short_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}B"


def _groups(decisions) -> list[list[LayerDecision]]:
    """Consecutive layers of the same kind with identical decisions, for a compact table."""
    groups: list[list[LayerDecision]] = []
    for d in decisions:
        def key(x: LayerDecision) -> tuple:
            return (x.kind, x.chunks, x.activation, x.delivery, x.reduction, x.host_copy)

        if groups and groups[-1][0].kind == BLOCK and d.kind == BLOCK and key(d) == key(groups[-1][0]):
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


class _Stop(Exception):
    """A problem after which the other checks cannot run."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_plan(plan: "Plan", world_size: int | None, out: list[str]) -> None:
    def bad(message: str, stop: bool = False) -> None:
        out.append(message)
        if stop:
            raise _Stop

    w = plan.workload
    for name, least in (("batch_size", 1), ("seq_len", 2), ("world_size", 1), ("micro_batches", 1)):
        value = getattr(w, name)
        if not _is_int(value) or value < least:
            bad(f"workload.{name} must be an integer >= {least}, got {value!r}")
    if w.precision not in ("bf16", "fp32"):
        bad(f"workload.precision must be 'bf16' or 'fp32', got {w.precision!r}")
    if not isinstance(w.compiled_blocks, bool):
        bad(f"workload.compiled_blocks must be true or false, got {w.compiled_blocks!r}")
    if world_size is None:
        world_size = w.world_size if _is_int(w.world_size) and w.world_size >= 1 else 1
    hosts = w.hosts if _is_int(w.hosts) and w.hosts >= 1 else 1
    if not _is_int(w.hosts) or w.hosts < 1 or world_size % w.hosts:
        bad(f"workload.hosts must be an integer >= 1 dividing world_size {world_size}, got {w.hosts!r}")
    elif w.hosts > 1 and not (_is_number(w.link_bytes_per_s) and w.link_bytes_per_s > 0):
        bad(f"workload.link_bytes_per_s must be > 0 with {w.hosts} hosts, got {w.link_bytes_per_s!r}")
    if not isinstance(plan.model_fingerprint, str):
        bad(f"model_fingerprint must be a string, got {plan.model_fingerprint!r}")
    if not _is_int(plan.budget_bytes) or plan.budget_bytes <= 0:
        bad(f"budget_bytes must be an integer > 0, got {plan.budget_bytes!r}")
    if not isinstance(plan.hardware, dict):
        bad(f"hardware must be a mapping of the profile's fields, got {type(plan.hardware).__name__}", stop=True)
    peak = plan.explanation.peak_device_bytes
    if not _is_int(peak) or peak < 0:
        bad(f"peak_device_bytes must be an integer >= 0, got {peak!r}")
    elif _is_int(plan.budget_bytes) and peak > plan.budget_bytes:
        bad(f"peak_device_bytes: the plan's peak {format_bytes(peak)} ({peak} bytes) exceeds its budget "
            f"{format_bytes(plan.budget_bytes)} ({plan.budget_bytes} bytes)")

    host = plan.explanation.peak_host_bytes
    if not _is_int(host) or host < 0:
        bad(f"peak_host_bytes must be an integer >= 0, got {host!r}")

    s = plan.schedule
    decisions = s.decisions
    if not decisions:
        bad("decisions: the plan has no layer decisions", stop=True)
    n = len(decisions)
    routes_allowed = world_size > 1  # without GPU peer-to-peer their collectives go through host memory
    kinds = [PROLOGUE] + [BLOCK] * (n - 2) + [EPILOGUE] if n >= 2 else [PROLOGUE]
    for i, d in enumerate(decisions):
        at = f"decisions[{i}]"
        if not isinstance(d, LayerDecision):
            bad(f"{at} must be a layer decision, got {type(d).__name__}", stop=True)
        if d.layer_id != i or not _is_int(d.layer_id):
            bad(f"{at}.layer_id must be {i} (one decision per layer, in order), got {d.layer_id!r}")
        if not isinstance(d.name, str) or not d.name:
            bad(f"{at}.name must be the layer's name, got {d.name!r}")
        if d.kind != kinds[i]:
            bad(f"{at}.kind must be {kinds[i]!r} (a prologue, the blocks, an epilogue), got {d.kind!r}")
        if not _is_int(d.numel) or d.numel < 1:
            bad(f"{at}.numel must be an integer >= 1, got {d.numel!r}")
        if not _is_int(d.chunks) or d.chunks < 1 or (_is_int(d.numel) and d.chunks > d.numel):
            bad(f"{at}.chunks must be an integer from 1 to numel ({d.numel!r}), got {d.chunks!r}")
        legal = BLOCK_ACTIVATIONS if d.kind == BLOCK else ("resident", "streamed")
        if d.activation not in legal:
            bad(f"{at}.activation: activation policy {d.activation!r} is not one for a {d.kind} "
                f"({' or '.join(map(repr, legal))})")
        for field_name, value, plain, routed in (("delivery", d.delivery, "replicated", "sharded"),
                                                 ("reduction", d.reduction, "cpu", "gpu")):
            if value not in (plain, routed):
                bad(f"{at}.{field_name} must be {plain!r} or {routed!r}, got {value!r}")
            elif value == routed and not routes_allowed:
                bad(f"{at}.{field_name} {routed!r} needs several ranks (world_size {world_size}); only "
                    f"{plain!r} here")
        if d.host_copy not in ("kept", "on_load"):
            bad(f"{at}.host_copy must be 'kept' or 'on_load', got {d.host_copy!r}")
        elif d.host_copy == "on_load" and w.precision == "fp32":
            bad(f"{at}.host_copy 'on_load' has no meaning in fp32 precision (loads read the master): 'kept'")
        owners = d.owners
        if not isinstance(owners, tuple) or (owners and _is_int(d.chunks) and len(owners) != d.chunks):
            bad(f"{at}.owners must name one rank per chunk ({d.chunks!r}) or none, got {owners!r}")
        elif any(not _is_int(o) or not 0 <= o < world_size for o in owners):
            bad(f"{at}.owners must be ranks 0..{world_size - 1} (world_size {world_size}), got {list(owners)}")
    if out:
        raise _Stop

    blocks = n - 2
    if not _is_int(s.window) or not 1 <= s.window <= max(blocks, 1):
        bad(f"window must be an integer from 1 to the number of blocks ({blocks}), got {s.window!r}")
    else:
        problem = _window_loads_problem(blocks, s.window, s.window_loads)
        if problem:
            bad(f"window_loads: {problem}")
    ids = set(range(n))
    if s.update_order and sorted(s.update_order) != list(range(n)):
        bad(f"update_order must be every layer id 0..{n - 1} once, got {list(s.update_order)}")
    for name in ("device_state", "early_order", "streamed_updates"):
        value = getattr(s, name)
        if any(not _is_int(v) or v not in ids for v in value) or len(set(value)) != len(value):
            bad(f"{name} must be distinct layer ids 0..{n - 1}, got {list(value)}")
    for a, b in (("early_order", "device_state"), ("streamed_updates", "device_state"),
                 ("streamed_updates", "early_order")):
        both = set(getattr(s, a)) & set(getattr(s, b))
        if both:
            bad(f"{a} and {b} must not share layers (state on the host vs on the device, updated once), "
                f"both hold {sorted(both, key=str)}")
    if not isinstance(s.early_in_place, bool):
        bad(f"early_in_place must be true or false, got {s.early_in_place!r}")
    elif s.early_in_place and (not s.early_order or s.streamed_gradients):
        bad("early_in_place: only early updates (early_order, gradients not streamed) are written in place")
    if not isinstance(s.device_state_sharded, bool):
        bad(f"device_state_sharded must be true or false, got {s.device_state_sharded!r}")
    elif s.device_state_sharded:
        if world_size == 1:
            bad("device_state_sharded: the device state is sharded over several ranks, the plan runs on 1")
        if hosts > 1:
            bad(f"device_state_sharded: over {hosts} hosts every host keeps the device state whole (a full "
                "copy per rank)")
        if not s.device_state:
            bad("device_state_sharded: there is no device state to shard (device_state is empty)")
        unowned = [decisions[i].name for i in s.device_state if _is_int(i) and 0 <= i < n
                   and not decisions[i].owners]
        if unowned:
            bad(f"device_state_sharded: {', '.join(unowned[:4])} name no chunk owners (decisions[i].owners)")
    if s.early_order and world_size != 1 and s.streamed_gradients is not True:
        bad(f"early_order: updates during the backward need one rank, the plan runs on {world_size}")
    if not isinstance(s.streamed_gradients, bool):
        bad(f"streamed_gradients must be true or false, got {s.streamed_gradients!r}")
    elif s.streamed_gradients:
        host_layers = ids - set(s.device_state)
        landing = [i for i in list(range(n - 2, -1, -1)) + [n - 1] if i in host_layers]
        if list(s.early_order) != landing or s.streamed_updates:
            bad("streamed_gradients: every host layer is updated as its gradient lands: early_order must be "
                f"{landing} (last block first, the epilogue last) and streamed_updates empty")
        summed = [decisions[i].name for i in landing if world_size > 1 and decisions[i].reduction == "cpu"]
        if summed:
            bad(f"streamed_gradients with {world_size} ranks: every host layer reduced on the GPUs, "
                f"{', '.join(summed[:4])} reduced on the CPUs")
    if not _is_int(s.loss_chunk_tokens) or s.loss_chunk_tokens < 0:
        bad(f"loss_chunk_tokens must be an integer >= 0, got {s.loss_chunk_tokens!r}")
    vocab = [d.layer_id for d in decisions if isinstance(d, LayerDecision) and d.activation == "streamed"]
    if not _is_int(s.vocab_chunk_rows) or s.vocab_chunk_rows < 0 or (vocab and s.vocab_chunk_rows < 1):
        bad(f"vocab_chunk_rows must be an integer >= 0 (>= 1 with a streamed table), got {s.vocab_chunk_rows!r}")
    if set(vocab) & set(s.device_state):
        bad(f"a streamed vocabulary table's layer keeps no optimizer state on the device, got {vocab}")


def _window_loads_problem(n_blocks: int, window: int, loads) -> str | None:
    """Why `loads` cannot run the 2N block visits in `window` slots (None: they can); the rule of
    backend/lowering/weight_window.schedule_window, which the backend applies again."""
    sequence = tuple(range(n_blocks)) + tuple(range(n_blocks - 1, -1, -1))
    where: dict[int, int] = {}
    by_position: dict[int, Load] = {}
    for k, load in enumerate(loads):
        if not isinstance(load, Load) or not all(_is_int(v) for v in (load.position, load.block, load.slot,
                                                                        load.issue_after)):
            return f"load {k} must be 4 integers [position, block, slot, issue_after], got {load!r}"
        if not 0 <= load.position < len(sequence) or load.position in by_position:
            return f"load {k}: position {load.position} is not a block visit 0..{len(sequence) - 1} of its own"
        if k and load.position < loads[k - 1].position:
            return f"load {k}: positions must increase, {load.position} after {loads[k - 1].position}"
        if not -1 <= load.issue_after < load.position:
            return f"load {k}: issue_after must be -1 or a visit before {load.position}, got {load.issue_after}"
        by_position[load.position] = load
    for p, block in enumerate(sequence):
        load = by_position.get(p)
        if load is not None:
            if load.block != block or not 0 <= load.slot < window:
                return (f"load at visit {p} must bring block {block} into one of {window} slots, "
                        f"got block {load.block} into slot {load.slot}")
            where = {b: slot for b, slot in where.items() if slot != load.slot}
            where[block] = load.slot
        if block not in where:
            return f"block {block} is read at visit {p} but no load brings it"
    return None


def _device_state_line(plan: "Plan") -> str:
    """The layers whose optimizer state lives on the device, its bytes per rank, and its layout."""
    per_rank = format_bytes(plan.memory.get("device_state_bytes", 0))
    W = plan.workload.world_size
    layout = (f"{per_rank} per rank, sharded by chunk owner over {W} ranks: gradient reduce-scattered, each "
              "rank updates its chunks, weights all-gathered at each load" if plan.device_state_sharded else
              f"{per_rank}" + (f" per rank, the same full copy on each of {W} ranks" if W > 1 else ""))
    return (f"  optimizer state on the device: {_blocks_label(plan.decisions, plan.device_state)} ({layout}; "
            "updated there, no PCIe traffic)")


def _copies_line(plan: "Plan") -> str:
    """The layers whose delivery copy is made on load, and the host RAM that saves."""
    made = [d for d in plan.decisions if d.host_copy == "on_load"]
    saved = sum(d.numel for d in made) * 2  # bf16
    return (f"  delivery copies made on load: {_blocks_label(plan.decisions, [d.layer_id for d in made])} "
            f"({format_bytes(saved)} less host RAM; their loads read the fp32 master, twice the bytes, "
            "cast on the device)")


def _out_of_place(plan: "Plan") -> str:
    """The end of the early updates' line when they write out of place: what nonfinite="stop" would save."""
    spare = (plan.host_memory or {}).get("spare", 0)
    return ("; out of place, so that a non-finite step is taken back: with nonfinite='stop' they would write in "
            f"place, {format_bytes(spare)} less host RAM and fewer bytes for the CPU)" if spare else ")")


def _host_line(plan: "Plan") -> str:
    """Host RAM of the plan, per parameter of the whole model, and by category."""
    params = sum(d.numel for d in plan.decisions)
    per_param = f" ({plan.peak_host_bytes / params:.2f} B per parameter)" if params else ""
    names = {"state": "host state", "spare": "early updates' spare state",
             "offloaded_activations": "offloaded activations", "pinned_buffers": "pinned buffers",
             "load_staging": "device state's staging"}
    parts = ", ".join(f"{names.get(k, k)} {format_bytes(v)}" for k, v in plan.host_memory.items() if v)
    budget = plan.solver.get("host_budget_bytes")
    each = " per host" if plan.workload.hosts > 1 else ""
    return (f"  host memory{each}: {format_bytes(plan.peak_host_bytes)}{per_param}"
            + (f" of {format_bytes(budget)}" if budget else "") + (f": {parts}" if parts else ""))
