"""The device's weights during a pass: the resident layers (prologue, epilogue) and the window's slots.

A prologue or epilogue whose vocabulary table streams (vocab_stream.py) keeps only its other
parameters resident, packed in its buffer (`device_locate`); the table crosses chunk by chunk.

Resident layers are loaded (H2D) at the start of a step, again only after an update changed them;
a block's weights go into one of the window's slots when the program's H2D op says so, and the
block runs with views of that slot. Buffers and frozen parameters (constants) go to the device once.
"""

from __future__ import annotations

import torch
from torch import nn

from slidedp.backend.runtime.routes import Routes
from slidedp.backend.runtime.streams import Streams
from slidedp.backend.runtime.vocab_stream import VocabStream, vocab_tables
from slidedp.backend.state.host_state import HostState
from slidedp.ir.graph import Layer, LayerGraph


class WeightWindow:
    """Device weights of one rank: resident layers, the window's slots, and the model's constants."""

    def __init__(self, model: nn.Module, graph: LayerGraph, host: HostState, routes: Routes, streams: Streams, *,
                 blocks: list[nn.Module], block_layers: list[Layer], n_slots: int, device: torch.device,
                 compute_dtype: torch.dtype, vocab_streamed=(), vocab_chunk_rows: int = 0):
        self.host, self.routes, self.streams = host, routes, streams
        self.block_layers = block_layers
        self.device, self.dtype = device, compute_dtype
        self.resident_ids = (graph.prologue.id, graph.epilogue.id)
        self.resident_stale: set[int] = set(self.resident_ids)  # resident weights to (re)load
        # Where each stored parameter lives: name -> (layer id, start, numel).
        self.locate = {
            name: (layout.layer_id, start, numel)
            for layout in host.layouts
            for name, start, numel, _ in layout.param_offsets
        }
        # Vocabulary-streamed tables (vocab_stream.py): not resident; their layer's other parameters are.
        self.vocab = vocab_tables(graph, host, vocab_streamed, vocab_chunk_rows)
        self.vocab_stream = VocabStream(host, routes, streams, device=device, dtype=compute_dtype)
        # Where each resident parameter lives on the device: name -> (layer id, start, numel) in its
        # layer's resident buffer (a streamed layer's buffer holds its other parameters, packed).
        self.device_locate: dict[str, tuple[int, int, int]] = {}
        self.resident_parts: dict[int, list[tuple[int, int, int]]] = {}  # lid -> (device start, host start, numel)
        for lid in self.resident_ids:
            at, parts = 0, []
            for name, start, numel, _ in host.layouts[lid].param_offsets:
                if lid in self.vocab and name == self.vocab[lid].name:
                    continue
                self.device_locate[name] = (lid, at, numel)
                parts.append((at, start, numel))
                at += numel
            self.resident_parts[lid] = parts
        # Resident layers: device weights (compute dtype) loaded at the start of each step.
        self.resident = {
            lid: torch.empty(sum(n for _, _, n in self.resident_parts[lid]), dtype=compute_dtype, device=device)
            for lid in self.resident_ids
        }
        max_block = max(layer.numel for layer in block_layers)
        self.slots = [torch.empty(max_block, dtype=compute_dtype, device=device) for _ in range(n_slots)]
        # Constants: buffers and frozen parameters, on the device once.
        prefix = graph.blocks_path + "."
        self.top_constants = {
            name: self._constant(t) for name, t in constants(model) if not name.startswith(prefix)
        }
        self.block_constants = [
            {name: self._constant(t) for name, t in constants(block)} for block in blocks
        ]

    def _constant(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):  # frozen parameter: compute dtype like the others
            return t.detach().to(self.device, self.dtype if t.is_floating_point() else t.dtype)
        return t.detach().to(self.device)

    def ensure_resident(self, layer_id: int) -> None:
        """H2D of a prologue/epilogue layer's weights if an update changed them since the last load."""
        if layer_id not in self.resident_stale:
            return
        if layer_id in self.vocab:
            for at, start, numel in self.resident_parts[layer_id]:
                self.routes.load_range(layer_id, self.resident[layer_id][at : at + numel], start, start + numel)
        else:
            self.routes.load(layer_id, self.resident[layer_id], self.host.layers[layer_id].source)
        self.streams.wait("compute", self.streams.record("h2d"))
        self.resident_stale.discard(layer_id)

    def load_block(self, block: int, slot: int) -> None:
        """H2D of a block's weights into a slot, by the layer's delivery route."""
        layer = self.block_layers[block]
        self.routes.load(layer.id, self.slots[slot], self.host.layers[layer.id].source)

    def block_params(self, block: int, slot: int, requires_grad: bool) -> dict[str, torch.Tensor]:
        """A block's weights as views of the slot holding them (leaves when `requires_grad`), and its constants."""
        layer = self.block_layers[block]
        flat = self.slots[slot]
        prefix = layer.name + "."
        out = {}
        for name, start, numel, shape in self.host.layouts[layer.id].param_offsets:
            view = flat[start : start + numel].view(shape)
            if requires_grad:
                view = view.detach().requires_grad_(True)
            out[name[len(prefix):]] = view
        out.update(self.block_constants[block])
        return out

    def block_spans(self, block: int) -> list[tuple[int, int]]:
        """(start, numel) of each of a block's parameters in its flat gradient."""
        return [(start, numel) for _, start, numel, _ in self.host.layouts[self.block_layers[block].id].param_offsets]


def constants(module: nn.Module):
    """Buffers and frozen parameters: what a functional call needs besides trainable weights."""
    for name, b in module.named_buffers():
        yield name, b
    for name, p in module.named_parameters():
        if not p.requires_grad:
            yield name, p
