"""The analytical step-time model: each term a small function with its equation and units."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from slidedp.costmodel.hardware import Hardware
from slidedp.costmodel.memory import DTYPE_BYTES
from slidedp.ir.graph import LayerGraph


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    h2d_s: float
    d2h_s: float
    cpu_update_s: float
    exposed_s: float  # pipeline fill and drain that nothing hides
    step_s: float
    bottleneck: str

    def to_dict(self) -> dict:
        return asdict(self)


def compute_time_s(graph: LayerGraph, hw: Hardware, micro_batches: int, activation: dict[int, str]) -> float:
    """t = micro_batches * sum_l (fwd_l + bwd_l + [recompute] fwd_l) / (matmul rate * efficiency)."""
    flops = 0.0
    for layer in graph.layers:
        recompute = activation.get(layer.id) == "recompute"
        flops += layer.costs.flops_fwd * (2 if recompute else 1) + layer.costs.flops_bwd
    return micro_batches * flops / (hw.matmul_flops_per_s * hw.block_efficiency)


def h2d_time_s(graph: LayerGraph, hw: Hardware, window: int) -> float:
    """t = bytes of every block's weights, loaded for forward and again for backward (minus the
    `window` blocks still resident at the turn), plus the resident layers once, over H2D bandwidth."""
    c = DTYPE_BYTES[graph.compute_dtype]
    blocks = graph.blocks
    reloaded = sum(b.numel for b in blocks[: max(0, len(blocks) - window)])
    total = sum(b.numel for b in blocks) + reloaded + graph.prologue.numel + graph.epilogue.numel
    return total * c / hw.h2d_bytes_per_s


def d2h_time_s(graph: LayerGraph, hw: Hardware) -> float:
    """t = every gradient once, in the compute dtype, over D2H bandwidth."""
    return graph.numel * DTYPE_BYTES[graph.compute_dtype] / hw.d2h_bytes_per_s


def cpu_update_time_s(graph: LayerGraph, hw: Hardware) -> float:
    """t = parameters / (CPU AdamW rate x the fraction left while DMA runs)."""
    return graph.numel / (hw.cpu_adamw_params_per_s * hw.cpu_adamw_contended_fraction)


def step_time(graph: LayerGraph, hw: Hardware, *, window: int, micro_batches: int,
              activation: dict[int, str], overlap_updates: bool) -> StepTime:
    """step = max(compute, H2D, D2H) + exposed; the CPU update adds in full unless overlapped.

    exposed = the first block's load + the last block's gradient copy (pipeline fill and drain).
    """
    compute = compute_time_s(graph, hw, micro_batches, activation)
    h2d = h2d_time_s(graph, hw, window)
    d2h = d2h_time_s(graph, hw)
    cpu = cpu_update_time_s(graph, hw)
    c = DTYPE_BYTES[graph.compute_dtype]
    first = max(b.numel for b in graph.blocks) * c
    exposed = first / hw.h2d_bytes_per_s + first / hw.d2h_bytes_per_s
    lanes = {"compute": compute, "h2d": h2d, "d2h": d2h}
    if overlap_updates:
        lanes["cpu_update"] = cpu
    bottleneck = max(lanes, key=lanes.get)
    step = lanes[bottleneck] + exposed + (0.0 if overlap_updates else cpu)
    if not overlap_updates and cpu > lanes[bottleneck]:
        bottleneck = "cpu_update"
    return StepTime(compute, h2d, d2h, cpu, exposed, step, bottleneck)
