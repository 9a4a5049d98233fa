"""What one pass over the weights carries between the program's ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slidedp.backend.runtime.embedding_grads import EmbeddingGrads
from slidedp.backend.runtime.pass_gradients import PassGradients
from slidedp.backend.runtime.saved_activations import SavedActivations
from slidedp.backend.runtime.weight_slots import WeightWindow
from slidedp.ir.blocks import BlockCall
from slidedp.ir.graph import LayerGraph


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] on the device
    labels: torch.Tensor  # [b, s] on the device, unshifted, -100 ignored
    attention_mask: torch.Tensor | None


@dataclass
class KeptForward:
    """A kept block's forward for one micro-batch: its input leaf, output and graph's weights."""

    x: torch.Tensor
    out: torch.Tensor
    params: dict[str, torch.Tensor]
    saved: SavedActivations


class PassState:
    """What one pass carries between its ops: block inputs, activations, gradients, the loss."""

    def __init__(self, model: nn.Module, graph: LayerGraph, weights: WeightWindow, n_blocks: int, micro_batches,
                 global_tokens, device: torch.device):
        n, m = n_blocks, len(micro_batches)
        self.micro_batches, self.global_tokens = micro_batches, global_tokens
        self.device = device
        self.leaves = {
            name: weights.resident[lid][start : start + numel].view(model.get_parameter(name).shape)
            .detach().requires_grad_(True)
            for name, (lid, start, numel) in weights.device_locate.items()
        }
        # a streamed table (a tied one once): a stand-in of its shape holding one element (vocab_stream.py
        # computes with it)
        for table in {t.name: t for t in weights.vocab.values()}.values():
            self.leaves[table.name] = torch.zeros((), dtype=weights.dtype, device=device).expand(
                table.rows, table.hidden).detach().requires_grad_(True)
        self.top = {**self.leaves, **weights.top_constants}
        self.grads = PassGradients(weights.resident, weights.device_locate, len(graph.layers), device,
                                   parts=weights.resident_parts, streamed=weights.vocab)
        self.embedding_grads = EmbeddingGrads(  # the prologue's weights, any of them an embedding table
            {id(self.leaves[p.name]): (self.leaves[p.name], None if p.name in self.grads.streamed_names
                                       else self.grads.acc_view(p.name, self.leaves[p.name].shape))
             for p in graph.prologue.params})
        self.calls: list[list[BlockCall]] = []
        self.h0: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor | None] = []
        self.stash: list[list[torch.Tensor | None]] = [[None] * m for _ in range(n)]
        self.kept: list[list[KeptForward | None]] = [[None] * m for _ in range(n)]
        self.grad_h: list[torch.Tensor] = []
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)


def model_kwargs(allowed: tuple[str, ...], mb: MicroBatch) -> dict:
    """Keyword arguments of the model's own forward for a micro-batch (no KV cache, its padding mask)."""
    out = {"use_cache": False} if "use_cache" in allowed else {}
    if mb.attention_mask is not None:
        out["attention_mask"] = mb.attention_mask
    return out
