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
host arrays (the next gradient copy, a checkpoint, close) waits on the host (`wait`). With several
ranks each rank updates the chunks it owns on its own device, and marks the layer updated for the
others once its copies down have landed (`on_done`); their loads wait for every rank. The result is
that of the CPU optimizer: both are torch's AdamW arithmetic on fp32, and tests/engine compare them
with torch.optim.AdamW.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from slidedp.backend.state.device_state import adamw_piece_
from slidedp.backend.state.host_state import HostState
from slidedp.backend.runtime.streams import Streams
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
                 piece_numel: int | None = None, on_done: Callable[[int], None] | None = None):
        self.host, self.streams, self.device = host, streams, device
        # With several ranks: told on a thread of its own once a layer's update has written the host
        # state (the rank marks it updated for the others, step_flags.py)
        self.on_done = on_done
        self._marker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slidedp-streamed") if on_done else None
        self._marks: list[Future] = []
        self.order = list(layer_ids)
        self._ids = set(self.order)
        lean = [i for i in self.order if host.layers[i].layout.lean]
        if lean:
            raise ValueError(f"layers {lean} keep their state on the device; they cannot be streamed")
        self.ready: dict[int, torch.cuda.Event | None] = {}  # each layer's last piece down
        n = min(piece_numel or memory.STREAMED_PIECE_NUMEL, max(host.layers[i].layout.numel for i in self.order))
        first = host.layers[self.order[0]]
        copy = next((host.layers[i].delivery for i in self.order if host.layers[i].delivery is not None), None)
        self.piece_numel = n
        self.slots = [
            _Slot(*(torch.empty(n, dtype=torch.float32, device=device) for _ in range(3)),
                  torch.empty(n, dtype=first.grad.dtype, device=device),
                  None if copy is None else torch.empty(n, dtype=copy.dtype, device=device))
            for _ in range(memory.STREAMED_SLOTS)]
        self._next = 0

    def __contains__(self, layer_id: int) -> bool:
        return layer_id in self._ids

    def update(self, layer_id: int, segments, opt: AdamW, *, step: int, clip: float, ranges=None) -> None:
        """Enqueue the layer's round trip; `segments` are its (start, end, decay) runs, `ranges` the
        (start, end) parts this rank updates (default: all of it; with several ranks, its chunks)."""
        arrays = self.host.layers[layer_id]
        s = self.streams
        with s.on("update"):  # a fill on the device: no host synchronisation
            steps = [torch.full((), float(step), dtype=torch.float32, device=self.device)]
        ranges = [(0, arrays.layout.numel)] if ranges is None else ranges
        pieces = [(lo, min(lo + self.piece_numel, end)) for start, end in ranges
                  for lo in range(start, end, self.piece_numel)]
        for lo, hi in pieces:
            slot = self.slots[self._next]
            self._next = (self._next + 1) % len(self.slots)
            pairs = [(slot.master, arrays.master), (slot.exp_avg, arrays.exp_avg),
                     (slot.exp_avg_sq, arrays.exp_avg_sq)]
            s.wait("h2d", slot.free)
            here = arrays.at(lo, hi)  # where the piece sits in this host's arrays
            for dev, host in pairs + [(slot.grad, arrays.grad)]:
                s.copy("h2d", dev[: hi - lo], host[here])
            s.wait("update", s.record("h2d"))
            with s.on("update"):
                for start, end, decay in segments:
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        adamw_piece_(slot.master[a - lo : b - lo], slot.exp_avg[a - lo : b - lo],
                                     slot.exp_avg_sq[a - lo : b - lo], slot.grad[a - lo : b - lo], steps, opt,
                                     decay=decay, clip=clip)
                if arrays.delivery is not None:  # a layer whose copy is made on load has none to write
                    slot.delivery[: hi - lo].copy_(slot.master[: hi - lo])
            s.wait("d2h", s.record("update"))
            if arrays.delivery is not None:
                pairs.append((slot.delivery, arrays.delivery))
            for dev, host in pairs:
                s.copy("d2h", host[here], dev[: hi - lo])
            slot.free = s.record("d2h")
        self.ready[layer_id] = s.record("d2h")
        if self.on_done is not None:
            for mark in [m for m in self._marks if m.done()]:
                self._marks.remove(mark)
                mark.result()  # re-raises a failed mark
            self._marks.append(self._marker.submit(self._mark, layer_id, self.ready[layer_id]))

    def _mark(self, layer_id: int, event) -> None:
        if event is not None:
            event.synchronize()
        self.on_done(layer_id)

    def wait(self, layer_id: int) -> None:
        """Block until the layer's last update has written the host state."""
        event = self.ready.get(layer_id)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        """Block until every update enqueued has written the host state (and has been told)."""
        for layer_id in self.order:
            self.wait(layer_id)
        marks, self._marks = self._marks, []
        for mark in marks:
            mark.result()

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            if self._marker is not None:
                self._marker.shutdown(wait=True)
