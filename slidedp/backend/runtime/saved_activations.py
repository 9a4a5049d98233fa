"""What a block's forward saves for its backward, when the plan keeps or offloads activations.

The forward of a kept block runs under autograd and its graph lives until the block's backward.
Two things need care, both handled by saved-tensor hooks:

- Weights: autograd saves (views of) the block's weights, which live in a device slot that other
  blocks overwrite before the backward. The pack hook replaces any tensor in the slot by a
  reference (offset, shape, stride); the unpack hook rebuilds it from whichever slot holds the
  block's weights at backward time (same layout, same values: weights do not change in a step).
- Offload: activations are copied to host memory on the D2H stream during the forward; `reload`
  (the program's h2d_saved op) copies them back on the H2D stream ahead of the backward, which the
  unpack hook then hands out (without that op, it copies them back on the compute stream). Small tensors
  (< `min_offload_bytes`) stay on the device. The host memory is a `HostArena`: one buffer, sized
  by the plan's offloaded bytes, registered with CUDA once (cudaHostRegister) and reused every
  pass (the caching allocator of pinned memory would round each tensor up to a power of two, up to
  twice the bytes); a tensor beyond the arena gets pinned memory of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.backend.runtime.streams import Streams
from slidedp.logs import warn_once


class HostArena:
    """One host buffer handed out front to back within a pass (`reset` at each pass's start)."""

    def __init__(self, nbytes: int, *, pin: bool, align: int = 512):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.align, self.used, self._registered = align, 0, False
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes for offloaded activations failed ({int(err)})")
            self._registered = True

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape` in the arena, or None if it does not fit."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // self.align) * self.align
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def reset(self) -> None:
        self.used = 0

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        self.buffer = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class SlotRef:
    """A saved tensor that was a view of the block's weight slot."""

    storage_offset: int  # elements from the slot's start
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class Offloaded:
    host: torch.Tensor
    event: object  # D2H completion (None on the CPU)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.Tensor | None = None  # back on the device ahead of the backward (`SavedActivations.reload`)


class SavedActivations:
    """Pack/unpack hooks for one block's forward; `slot` is set again before its backward."""

    def __init__(self, slot: torch.Tensor, streams: Streams, *, offload: bool, min_offload_bytes: int = 1 << 16,
                 arena: HostArena | None = None):
        self.slot = slot
        self.streams = streams
        self.offload = offload
        self.arena = arena
        self.min_offload_bytes = min_offload_bytes
        self.offloaded_bytes = 0
        self.offloaded: list[Offloaded] = []
        self.late_bytes = 0  # bytes the backward copied back itself (not reloaded ahead)

    def _in_slot(self, t: torch.Tensor) -> bool:
        return t.device == self.slot.device and t.untyped_storage().data_ptr() == self.slot.untyped_storage().data_ptr()

    def pack(self, t: torch.Tensor):
        if self._in_slot(t):
            return SlotRef(t.storage_offset() - self.slot.storage_offset(), tuple(t.shape), tuple(t.stride()))
        nbytes = t.numel() * t.element_size()
        if not self.offload or nbytes < self.min_offload_bytes or not t.is_contiguous():
            return t
        host = self.arena.take(t.shape, t.dtype) if self.arena is not None else None
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.streams.cuda)
        self.streams.wait("d2h", self.streams.record("compute"))
        self.streams.copy("d2h", host, t.detach())
        self.offloaded_bytes += nbytes
        self.offloaded.append(Offloaded(host, self.streams.record("d2h"), tuple(t.shape), tuple(t.stride())))
        return self.offloaded[-1]

    def reload(self, device: torch.device) -> None:
        """Every offloaded tensor back to `device` on the H2D stream (which the caller has made wait for
        the copies down), allocated in that stream's memory and handed to the compute stream (which
        waits for this op before the backward)."""
        for o in self.offloaded:
            with self.streams.on("h2d"):
                o.device = torch.empty(o.size, dtype=o.host.dtype, device=device)
            self.streams.copy("h2d", o.device, o.host)
            if self.streams.cuda:
                o.device.record_stream(self.streams.compute)

    def unpack(self, packed):
        if isinstance(packed, SlotRef):
            return self.slot.as_strided(packed.size, packed.stride, self.slot.storage_offset() + packed.storage_offset)
        if isinstance(packed, Offloaded):
            if packed.device is not None:
                return packed.device
            self.streams.wait("compute", packed.event)
            self.late_bytes += packed.host.numel() * packed.host.element_size()
            warn_once(("late-reload",), "offloaded activations were copied back inside their backward, on the "
                      "compute stream (no h2d_saved op brought them back ahead): steps run slower than the plan says")
            return packed.host.to(self.slot.device, non_blocking=True)
        return packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
