"""Every stream the executor uses, in one object; on the CPU they collapse to in-order execution.

- compute: the stream the model's kernels run on (the current stream at construction).
- h2d: weight copies host -> device, so loads of layer i+window overlap compute of layer i.
- d2h: gradient copies device -> host, so layer i's gradient drains while layer i-1 computes.
- update: AdamW of the layers whose optimizer state lives on the device (memory-bound kernels),
  beside the next step's compute-bound forward.

Waits are device-side (`stream.wait_event`), never host synchronisations, except where the CPU
itself must read what a copy wrote (the event's `synchronize`, before a host-side add or update).
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self.update = torch.cuda.Stream(device)

    def record(self, stream_name: str) -> "torch.cuda.Event | None":
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return event

    def wait(self, stream_name: str, event: "torch.cuda.Event | None") -> None:
        if self.cuda and event is not None:
            getattr(self, stream_name).wait_event(event)

    @contextlib.contextmanager
    def on(self, stream_name: str):
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(getattr(self, stream_name)):
            yield

    def copy(self, stream_name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src, enqueued on `stream_name` (asynchronous on CUDA from pinned host memory).

        Between host and device in two dtypes (the fp32 master into a bf16 slot: a delivery copy made
        on load) the cast runs on the device: the source lands in its own dtype and is cast there (or,
        down, is cast before it leaves). torch's copy_ would cast on the CPU, on this thread, through
        pageable memory. The landing buffer is allocated on this stream and freed once enqueued, so
        only this stream's later work reuses it (the cost model charges it to the load)."""
        with self.on(stream_name):
            if self.cuda and dst.dtype != src.dtype and dst.is_cuda != src.is_cuda:
                src = src.to(dst.device, non_blocking=True) if dst.is_cuda else src.to(dst.dtype)
            dst.copy_(src, non_blocking=self.cuda)
            if self.cuda:
                # The caching allocator must not hand dst's or src's memory to another stream's
                # work before this copy has finished.
                for t in (dst, src):
                    if t.is_cuda:
                        t.record_stream(getattr(self, stream_name))

    def range(self, name: str):
        """A profiler range named after the program's operation."""
        return torch.profiler.record_function(name)
