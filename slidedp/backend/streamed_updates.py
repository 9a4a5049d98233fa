"""Streamed updates: AdamW of some host layers on the device at the step boundary (`plan.streamed_updates`).

Once the step's norm is known (rank.py), each such layer's state makes a round trip through the
device, piece by piece (costmodel.memory.STREAMED_PIECE_NUMEL parameters), in the plan's order (the
order the next forward needs them):

    h2d:    the piece's fp32 master, exp_avg, exp_avg_sq and its gradient (as the host holds it)
            into a free slot (it waits for the slot's last copy down);
    update: AdamW in place (device_state.adamw_piece_, the clip coefficient applied to the gradient),
            then the delivery copy cast from the master (round to nearest even, as the CPU writes it);
    d2h:    master, moments and delivery copy back into the host state.

memory.STREAMED_SLOTS slots let a piece come up while the one before is updated and goes down. The
host state stays the one authority: nothing of these layers lives on the device between steps. The
next load of such a layer waits on the device for its last piece down (`ready`); whatever reads the
host arrays (the next gradient copy, a checkpoint, close) waits on the host (`wait`). The result is
that of the CPU optimizer: both are torch's AdamW arithmetic on fp32, and tests/engine compare them
with torch.optim.AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.backend.device_state import adamw_piece_
from slidedp.backend.host_state import HostState
from slidedp.backend.streams import Streams
from slidedp.costmodel import memory
from slidedp.optim import AdamW


@dataclass
class _Slot:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    delivery: torch.Tensor | None
    free: "torch.cuda.Event | None" = None  # its last copy down


class StreamedUpdates:
    def __init__(self, host: HostState, layer_ids, *, streams: Streams, device: torch.device,
                 piece_numel: int | None = None):
        self.host, self.streams, self.device = host, streams, device
        self.order = list(layer_ids)
        self._ids = set(self.order)
        lean = [i for i in self.order if host.layers[i].exp_avg.numel() != host.layers[i].layout.numel]
        if lean:
            raise ValueError(f"layers {lean} keep their moments on the device; they cannot be streamed")
        self.ready: dict[int, torch.cuda.Event | None] = {}  # each layer's last piece down
        n = min(piece_numel or memory.STREAMED_PIECE_NUMEL, max(host.layers[i].layout.numel for i in self.order))
        first = host.layers[self.order[0]]
        self.piece_numel = n
        self.slots = [
            _Slot(*(torch.empty(n, dtype=torch.float32, device=device) for _ in range(3)),
                  torch.empty(n, dtype=first.grad.dtype, device=device),
                  None if first.delivery is None else torch.empty(n, dtype=first.delivery.dtype, device=device))
            for _ in range(memory.STREAMED_SLOTS)]
        self._next = 0

    def __contains__(self, layer_id: int) -> bool:
        return layer_id in self._ids

    def update(self, layer_id: int, segments, opt: AdamW, *, step: int, clip: float) -> None:
        """Enqueue the layer's round trip; `segments` are its (start, end, decay) runs."""
        arrays = self.host.layers[layer_id]
        s = self.streams
        with s.on("update"):  # a fill on the device: no host synchronisation
            steps = [torch.full((), float(step), dtype=torch.float32, device=self.device)]
        for lo in range(0, arrays.layout.numel, self.piece_numel):
            hi = min(lo + self.piece_numel, arrays.layout.numel)
            slot = self.slots[self._next]
            self._next = (self._next + 1) % len(self.slots)
            pairs = [(slot.master, arrays.master), (slot.exp_avg, arrays.exp_avg),
                     (slot.exp_avg_sq, arrays.exp_avg_sq)]
            s.wait("h2d", slot.free)
            for dev, host in pairs + [(slot.grad, arrays.grad)]:
                s.copy("h2d", dev[: hi - lo], host[lo:hi])
            s.wait("update", s.record("h2d"))
            with s.on("update"):
                for start, end, decay in segments:
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        adamw_piece_(slot.master[a - lo : b - lo], slot.exp_avg[a - lo : b - lo],
                                     slot.exp_avg_sq[a - lo : b - lo], slot.grad[a - lo : b - lo], steps, opt,
                                     decay=decay, clip=clip)
                if slot.delivery is not None:
                    slot.delivery[: hi - lo].copy_(slot.master[: hi - lo])
            s.wait("d2h", s.record("update"))
            if arrays.delivery is not None:
                pairs.append((slot.delivery, arrays.delivery))
            for dev, host in pairs:
                s.copy("d2h", host[lo:hi], dev[: hi - lo])
            slot.free = s.record("d2h")
        self.ready[layer_id] = s.record("d2h")

    def wait(self, layer_id: int) -> None:
        """Block until the layer's last update has written the host state."""
        event = self.ready.get(layer_id)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        for layer_id in self.order:
            self.wait(layer_id)
