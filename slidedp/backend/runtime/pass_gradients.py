"""A pass's gradients on the device until the program's D2H op sends them to the host.

The resident layers' (prologue, epilogue) gradients are summed in fp32 accumulators as their
backward runs; a block's gradient is the flat fp32 buffer its backward packed. Each layer's sum of
squares is taken on the device (for exact clipping); its D2H op hands both to the layer's
reduction route (routes.py), which copies the gradient down chunk by chunk.
"""

from __future__ import annotations

import torch

from slidedp.backend.runtime.routes import Routes


class PassGradients:
    """Gradients of one pass: resident accumulators, per-layer sources and sums of squares."""

    def __init__(self, resident: dict[int, torch.Tensor], locate: dict[str, tuple[int, int, int]], n_layers: int,
                 device: torch.device, parts: dict | None = None, streamed: dict | None = None):
        self.locate, self.device = locate, device
        # vocabulary-streamed layers (vocab_stream.py): their resident parameters' places on the host
        # (device start, host start, numel), and the fp32 sum of squares of the chunks already sent
        self.parts, self.streamed = parts or {}, streamed or {}
        self.streamed_names = {t.name for t in self.streamed.values()}
        self.vocab_sumsq: dict[int, torch.Tensor] = {}
        self.resident_acc = {lid: torch.zeros(w.numel(), dtype=torch.float32, device=device)
                             for lid, w in resident.items()}
        self.sumsq: list[torch.Tensor | None] = [None] * n_layers  # of this pass's gradient, on the device
        self.grad_src: dict[int, torch.Tensor] = {}

    def acc_view(self, name: str, shape) -> torch.Tensor:
        """A resident parameter's part of its layer's fp32 accumulator, in the parameter's shape."""
        lid, start, numel = self.locate[name]
        return self.resident_acc[lid][start : start + numel].view(shape)

    def accumulate(self, names, grads) -> None:
        """Add resident parameters' gradients (any dtype; None skipped) into their fp32 accumulators."""
        for name, gp in zip(names, grads):
            if gp is not None:
                lid, start, numel = self.locate[name]
                self.resident_acc[lid][start : start + numel].add_(gp.reshape(-1).float())

    def finish_resident(self, layer_id: int) -> None:
        """A resident layer's gradient is whole: it waits for its D2H op (a streamed table's chunks
        have gone already; their sum of squares is added)."""
        self.finish(layer_id, self.resident_acc[layer_id])
        if layer_id in self.vocab_sumsq:
            self.sumsq[layer_id] = self.sumsq[layer_id] + self.vocab_sumsq.pop(layer_id)

    def send_vocab_chunk(self, routes: Routes, streams, layer_id: int, r0: int, r1: int, grad: torch.Tensor, *,
                         add: bool = False) -> None:
        """Layer `layer_id`'s use of a streamed table, chunk of rows [r0, r1): its fp32 gradient (this
        pass, made on the compute stream) sent down at once to the table's host gradient, added to
        what is there with `add` (a tied table's second use), and counted in the layer's sum of
        squares unless the table is tied (the sum of its uses is counted on the host: Routes)."""
        table = self.streamed[layer_id]
        flat = grad.reshape(-1)
        sq = None
        if not table.tied:
            sq = torch.dot(flat, flat)
            self.vocab_sumsq[layer_id] = sq if layer_id not in self.vocab_sumsq else self.vocab_sumsq[layer_id] + sq
        streams.wait("d2h", streams.record("compute"))
        routes.gradient_piece(table.layer_id, *table.flat(r0, r1), flat, add=add, sumsq=sq)

    def finish(self, layer_id: int, acc: torch.Tensor) -> None:
        """Sum of squares of a layer's fp32 gradient; the gradient waits for its D2H op."""
        self.sumsq[layer_id] = torch.dot(acc, acc) if acc.numel() else torch.zeros((), device=self.device)
        self.grad_src[layer_id] = acc

    def finish_packed(self, layer_id: int, acc: torch.Tensor, sumsq: torch.Tensor) -> None:
        """A block's packed gradient and the sum of squares the packing kernel took."""
        self.sumsq[layer_id] = sumsq
        self.grad_src[layer_id] = acc

    def send(self, routes: Routes, layer_id: int) -> None:
        """The layer's fp32 gradient to the host by its reduction route, chunk by chunk; cast on the
        D2H stream one chunk at a time when the host gradient is bf16 (costmodel.memory.grad_staging_bytes)."""
        acc = self.grad_src.pop(layer_id)
        if layer_id in self.streamed:  # the resident parameters' parts, then the layer is whole
            for at, start, numel in self.parts[layer_id]:
                routes.gradient_piece(layer_id, start, start + numel, acc[at : at + numel])
            routes.gradient_done(layer_id, self.sumsq[layer_id])
            return
        routes.gradient(layer_id, acc, self.sumsq[layer_id])
