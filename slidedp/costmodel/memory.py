"""Device memory of one rank under a set of decisions, buffer by buffer (bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.ir.graph import BLOCK, LayerGraph

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryBreakdown:
    resident_params_bytes: int  # prologue + epilogue weights, all step
    resident_grads_bytes: int  # their fp32 gradient accumulators
    weight_slots_bytes: int  # window x the largest block, compute dtype
    block_grad_bytes: int  # fp32 accumulator + per-parameter grads + D2H staging
    boundary_stash_bytes: int  # every block's input, per micro-batch in flight
    block_activation_bytes: int  # one block's forward+backward working set
    epilogue_activation_bytes: int  # logits, their fp32 copy and gradient

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f) for f in self.__dataclass_fields__)


def device_memory(
    graph: LayerGraph, *, window: int, micro_batches: int, activation: dict[int, str]
) -> MemoryBreakdown:
    """Peak device bytes: resident set + weight window + gradient path + activations.

    stash = (n_blocks + 1) x micro_batches x boundary; a kept block adds its saved bytes per
    micro-batch; a recomputed block costs its saved bytes once, while it is being recomputed.
    """
    c = DTYPE_BYTES[graph.compute_dtype]
    blocks = graph.blocks
    resident_numel = graph.prologue.numel + graph.epilogue.numel
    max_block = max(b.numel for b in blocks)
    boundary = max(b.costs.boundary_activation_bytes for b in blocks)
    kept = sum(b.costs.saved_activation_bytes for b in blocks if activation.get(b.id) == "keep")
    working = max(b.costs.saved_activation_bytes + b.costs.peak_workspace_bytes for b in blocks)
    epi = graph.epilogue.costs
    staging = 2 * max_block * 2 if c == 2 else 0
    return MemoryBreakdown(
        resident_params_bytes=resident_numel * c,
        resident_grads_bytes=resident_numel * 4,
        weight_slots_bytes=window * max_block * c,
        block_grad_bytes=2 * max_block * 4 + max_block * c + staging,
        boundary_stash_bytes=(len(blocks) + 3) * micro_batches * boundary,
        block_activation_bytes=kept * micro_batches + working,
        epilogue_activation_bytes=epi.saved_activation_bytes * 2 + epi.peak_workspace_bytes,
    )


def is_block(graph: LayerGraph, layer_id: int) -> bool:
    return graph.layers[layer_id].kind == BLOCK
