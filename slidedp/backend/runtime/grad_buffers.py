"""The fp32 gradient buffers of the blocks' backward: the plan's GRAD_ACCUMULATORS of them
(costmodel/memory.py), kept for the rank's life and taken in turn.

A block's backward fills the next buffer once the copy that read it last (the gradient of the block two
backwards earlier, on the D2H stream) has drained: the compute stream waits for that copy's event, as
the program orders (a block's backward after the gradient copy two blocks earlier). A buffer made per
block and freed with its copy pending (`Tensor.record_stream`) would instead be reused by the caching
allocator only once the CPU has seen the copy end: with the CPU ahead of the copies, it reserved a new
one per block (10.4 GiB for 3.7 GiB allocated, a 5.3 GiB plan whose gradient copies are its longest lane).
"""

from __future__ import annotations

import torch

from slidedp.backend.runtime.streams import Streams
from slidedp.costmodel.memory import GRAD_ACCUMULATORS


class GradientBuffers:
    """GRAD_ACCUMULATORS fp32 buffers of the largest block, made on first use and handed out in turn."""

    def __init__(self, numel: int, device: torch.device, streams: Streams):
        self.numel, self.device, self.streams = numel, device, streams
        self.buffers: list[torch.Tensor] = []
        self.drained: list[object] = [None] * GRAD_ACCUMULATORS  # per buffer: the event of its last copy
        self.turn = 0
        self.held: dict[int, int] = {}  # layer id -> the buffer holding its gradient until its copy

    def take(self, layer_id: int, numel: int) -> torch.Tensor:
        """The next buffer (its first `numel` elements) for `layer_id`'s gradient, once the compute stream
        has waited for the copy that read it last."""
        if not self.buffers:
            self.buffers = [torch.empty(self.numel, dtype=torch.float32, device=self.device)
                            for _ in range(GRAD_ACCUMULATORS)]
        i, self.turn = self.turn, (self.turn + 1) % GRAD_ACCUMULATORS
        self.streams.wait("compute", self.drained[i])
        self.drained[i] = None
        self.held[layer_id] = i
        return self.buffers[i][:numel]

    def drain(self, layer_id: int, event) -> None:
        """`layer_id`'s gradient has been read (copied, cast, reduced) by the work before `event` (on the D2H
        stream): its buffer may be filled again after it."""
        i = self.held.pop(layer_id, None)
        if i is not None:
            self.drained[i] = event
