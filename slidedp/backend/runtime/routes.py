"""How one rank moves a layer: its weights up, its gradient down, as the plan routes them.

Chunk c of a layer (the plan's `chunks`) is owned by rank `owners[c]`: that rank's CPU threads
update it, whatever the route. Per layer group the plan picks

- delivery `replicated`: every rank copies every chunk from the host (H2D);
  `sharded`: the owner copies the chunk, then broadcasts it to the other GPUs;
- reduction `gpu`: the chunk's gradient is summed onto its owner's GPU (reduce), and only the owner
  copies it to the host;
  `cpu`: every rank copies its whole gradient down, chunk by chunk, through staging buffers of its
  own, and adds it into the host gradient in rank order (a per-layer turn counter in the shared
  state), so the sum is the same in every run.

With one rank both routes are a plain copy. With the plan's `streamed_gradients` (one rank, or the
GPU reduction) each staged chunk a rank owns goes straight into the layer's update (`apply_gradient`)
and the host keeps no gradient. Gradients of a later pass (gradient accumulation over
several passes) are staged and added on the host. Host-side adds run on one reducer thread per
rank, so the device streams never wait for another rank. The norm of the whole gradient is the sum
over ranks of the squares of the chunks each rank owns, taken on the GPU where the reduced chunk is
there (one pass, GPU reduction or one rank), else on the host once every contribution has landed.

Layers whose update is streamed through the device (`streamed`) take the routes; with one rank
their next load waits for that update on the device, anything else that reads or writes their host
arrays on the host; with several, everything waits for every rank's mark (step_flags.py).

Layers whose optimizer state lives on the device (`device_state`) take neither route. When every
rank keeps the same copy, the weights are copied into the slot from the device's own master, the
gradient is summed over the ranks on the devices (all-reduce) into the device's buffer, and rank 0
alone counts it in the norm. Sharded by chunk owner (`device_state.sharded`), each owner casts its
chunks of the master into the slot and broadcasts them (an all-gather, on the H2D stream), each
chunk's gradient is summed onto its owner (reduces, a reduce-scatter, on the D2H stream) into the
owner's buffer, and each rank counts its own chunks in the norm.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from slidedp.backend.lowering.program import chunk_bounds
from slidedp.backend.state.step_flags import StepFlags
from slidedp.backend.runtime.streams import Streams
from slidedp.costmodel.memory import HOST_STAGING_SLOTS, chunk_owners


class Routes:
    def __init__(self, *, plan, host, streams: Streams, rank: int = 0, world_size: int = 1, comm=None,
                 flags: StepFlags | None = None, staging_slots: int = HOST_STAGING_SLOTS):
        self.rank, self.world_size, self.comm, self.flags = rank, world_size, comm, flags
        self.host, self.streams = host, streams
        self.delivery = {d.layer_id: d.delivery for d in plan.decisions}
        # one rank in its own process (flags) follows the plan's route; in the engine's process, a copy
        self.reduction = {d.layer_id: d.reduction if flags is not None else "gpu" for d in plan.decisions}
        self.chunks = {d.layer_id: chunk_bounds(d.numel, d.chunks) for d in plan.decisions}
        self._on_device = frozenset(plan.device_state)  # their gradients are never staged on the host
        self.owners = {d.layer_id: chunk_owners(d.owners, len(self.chunks[d.layer_id]), world_size)
                       for d in plan.decisions}
        self.rounds = 0  # update rounds started, the same on every rank
        self.wait_s = 0.0  # time spent in wait_updated (reset by the rank each step)
        self.passes = 0  # passes run, the same on every rank (tickets of the CPU reduction)
        # Set by the rank: blocks until this rank's own update of a layer is done (one-rank path).
        self.wait_local_update: Callable[[int], None] = lambda layer_id: None
        self._first = True
        self._device_sumsq: dict[int, torch.Tensor] = {}
        self._guards: list = []
        self._reducer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slidedp-reduce")
        self._pending: list[Future] = []
        self._grad_dtype, self._staging_slots = getattr(torch, host.layouts[0].grad_dtype), staging_slots
        self._staging: list[torch.Tensor] = []  # chunk-sized, allocated on first use (_take_slot)
        self._piece_tasks: dict[int, int] = {}  # streamed layer -> index of its first staged add this pass
        self._piece_sumsq: dict[int, torch.Tensor] = {}  # streamed layer -> its reduced owned parts' squares
        # streamed layers with pieces of two uses (a tied table): their norm is taken from the host gradient
        self._host_norm: set[int] = set()
        # CPU reduction of a streamed layer: its pieces so far this pass, and per pass (the same in every
        # pass: tickets of pass g start at g * pieces * world_size)
        self._piece_index: dict[int, int] = {}
        self._pieces_per_pass: dict[int, int] = {}
        self._free: queue.Queue[int] = queue.Queue()
        self.device_state = None  # backend.state.device_state.DeviceState, set by the rank when the plan has one
        self.streamed = None  # backend.runtime.streamed_updates.StreamedUpdates, likewise
        self.early = None  # backend.runtime.early_updates.EarlyRound of this step, told when each gradient lands
        self._last = True
        # Layers whose gradient streams into the update (plan.streamed_gradients, one rank): each staged
        # piece is handed to `apply_gradient(layer_id, staged, lo, hi, finite)` (set by the rank for the step;
        # None: no update, an evaluation) instead of landing in a host gradient.
        self.grads_streamed = frozenset(d.layer_id for d in plan.decisions if d.layer_id not in self._on_device) \
            if plan.streamed_gradients else frozenset()
        self.apply_gradient: Callable | None = None

    def owned(self, layer_id: int) -> list[tuple[int, int]]:
        return [c for c, o in zip(self.chunks[layer_id], self.owners[layer_id]) if o == self.rank]

    # -- the step boundary ----------------------------------------------------------------------
    def _streamed_here(self, layer_id: int) -> bool:
        """The layer's update is streamed through this process's device alone (one rank): its events
        say when it is done (with several ranks, every rank's mark does)."""
        return self.flags is None and self.streamed is not None and layer_id in self.streamed

    def wait_updated(self, layer_id: int) -> None:
        """Until every rank has finished the last started update of the layer."""
        if self.device_state is not None and layer_id in self.device_state:
            return  # updated on the device, in stream order
        t0 = time.perf_counter()
        if self._streamed_here(layer_id):
            self.streamed.wait(layer_id)
        elif self.flags is None:
            self.wait_local_update(layer_id)
        else:
            self.flags.wait_updated(layer_id, self.rounds)
        self.wait_s += time.perf_counter() - t0

    def begin_pass(self, first: bool, last: bool = True) -> None:
        self._first, self._last = first, last
        if first:
            self._device_sumsq = {}

    # -- weights up -----------------------------------------------------------------------------
    def load(self, layer_id: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The layer's weights from the host into the device buffer `dst` (on the H2D stream)."""
        if self.device_state is not None and layer_id in self.device_state:
            self.streams.wait("h2d", self.device_state.ready.get(layer_id))  # its last update
            d = self.device_state.layers[layer_id]
            if not self.device_state.sharded:
                self.streams.copy("h2d", dst, d.master)  # within the device, cast
                return
            for (lo, hi), owner in zip(self.chunks[layer_id], self.owners[layer_id]):
                if owner == self.rank:
                    off = d.at(lo, hi)
                    self.streams.copy("h2d", dst[lo:hi], d.master[off:off + hi - lo])
                with self.streams.on("h2d"):
                    self.comm.broadcast_(dst[lo:hi], owner)
            return
        if self._streamed_here(layer_id):
            self.streams.wait("h2d", self.streamed.ready.get(layer_id))  # its last update, on the device
        else:
            self.wait_updated(layer_id)
        sharded = self.world_size > 1 and self.delivery[layer_id] == "sharded"
        at = self.host.layers[layer_id].at  # where a range of the layer sits in this host's arrays
        for (lo, hi), owner in zip(self.chunks[layer_id], self.owners[layer_id]):
            if not sharded or owner == self.rank:
                self.streams.copy("h2d", dst[lo:hi], src[at(lo, hi)])
            if sharded:
                with self.streams.on("h2d"):
                    self.comm.broadcast_(dst[lo:hi], owner)

    def load_range(self, layer_id: int, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of a host layer's weights (a streamed table's chunk, or the layer's resident
        rest: vocab_stream.py) into `dst`, on the H2D stream, once the layer's last update is done, by
        the layer's delivery: every rank copies the range (replicated), or the owner of each chunk's
        part of it copies that part from its host and broadcasts it (sharded; several hosts)."""
        if self._streamed_here(layer_id):
            self.streams.wait("h2d", self.streamed.ready.get(layer_id))
        else:
            self.wait_updated(layer_id)
        arrays = self.host.layers[layer_id]
        if self.world_size == 1 or self.delivery[layer_id] != "sharded":
            self.streams.copy("h2d", dst, arrays.source[arrays.at(lo, hi)])
            return
        for a, b, owner in self.parts(layer_id, lo, hi):
            part = dst[a - lo : b - lo]
            if owner == self.rank:
                self.streams.copy("h2d", part, arrays.source[arrays.at(a, b)])
            with self.streams.on("h2d"):
                self.comm.broadcast_(part, owner)

    def parts(self, layer_id: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(a, b, owner) of each of the layer's chunks' intersection with elements [lo, hi), in order."""
        return [(max(lo, c0), min(hi, c1), owner) for (c0, c1), owner in zip(self.chunks[layer_id], self.owners[layer_id])
                if max(lo, c0) < min(hi, c1)]

    # -- gradients down -------------------------------------------------------------------------
    def gradient_piece(self, layer_id: int, lo: int, hi: int, piece: torch.Tensor, *, add: bool = False,
                       sumsq: torch.Tensor | None = None) -> None:
        """Elements [lo, hi) of this rank's fp32 gradient of a vocabulary-streamed layer for this pass
        (`piece`, flat, on the device, ready on the D2H stream) into the host gradient, by the layer's
        reduction: the CPU reduction through the staging buffers in rank order; the GPU reduction (each
        chunk's part of the piece summed onto its owner, which alone copies it down to its host, and
        counts it in the norm); with one rank a copy (a later pass adds). The pieces of a layer cover it
        once, and `gradient_done` ends it; `add`: a second use of elements already sent this pass (a
        tied table's embedding after its head), added on the host like a later pass, and the layer's
        norm taken there (from the sum). `sumsq`: the piece's sum of squares on the device, if taken (a
        streamed gradient's update then reads whether it is finite from it, not from the landed piece)."""
        target = self.host.layers[layer_id].grad
        piece = piece.reshape(-1)
        if piece.is_cuda:
            piece.record_stream(self.streams.d2h)
        size = self._staging_numel()
        if add:
            if layer_id in self.grads_streamed:
                raise ValueError(f"layer {layer_id}: a gradient of two uses (a tied table) cannot stream into the "
                                 "update (plan.streamed_gradients): its update needs their sum")
            self._host_norm.add(layer_id)
        if layer_id in self.grads_streamed and self.world_size == 1:  # the whole piece, into the update
            finite = self._finite_flag(sumsq)
            for a in range(0, hi - lo, size):
                self._stage((a, min(hi - lo, a + size)), piece,
                            lambda staged, a, b: self._into_update(layer_id, staged, lo + a, lo + b, finite))
            return
        if self.reduction[layer_id] == "cpu":
            # piece by piece in rank order (a turn per piece: with the sharded delivery a rank waiting
            # for its turn of the whole layer would hold the staging buffers while the other ranks
            # wait for it in the next chunk's broadcast)
            j = self._piece_index.get(layer_id, 0)
            self._piece_index[layer_id] = j + 1
            base = self.passes * self._pieces_per_pass[layer_id] * self.world_size if self.passes else 0
            ticket = base + j * self.world_size + self.rank
            overwrite = self._first and self.rank == 0 and not add
            parts = [(a, min(hi - lo, a + size)) for a in range(0, hi - lo, size)]
            for i, part in enumerate(parts):
                self._stage(part, piece, lambda staged, a, b, last=i == len(parts) - 1: self._add_in_turn(
                    layer_id, target[lo + a : lo + b], staged, ticket, overwrite, last))
            if not parts:
                self._pending.append(self._reducer.submit(self._pass_turn, layer_id, ticket))
            return
        at = self.host.layers[layer_id].at
        if self.world_size > 1:  # each chunk's part summed onto its owner: this rank copies its own parts
            mine, finite = [], []
            with self.streams.on("d2h"):
                for a, b, owner in self.parts(layer_id, lo, hi):
                    self.comm.reduce_(piece[a - lo : b - lo], owner)
                    if owner == self.rank:
                        mine.append((a, b))
                        part = piece[a - lo : b - lo]
                        sq = torch.dot(part, part)
                        finite.append(self._finite_flag(sq) if layer_id in self.grads_streamed else None)
                        self._piece_sumsq[layer_id] = sq + self._piece_sumsq[layer_id] \
                            if layer_id in self._piece_sumsq else sq
        else:  # one rank: the whole piece is its own (in staging-sized parts when added on the host)
            mine = [(lo, hi)] if self._first and not add else [(a, min(hi, a + size)) for a in range(lo, hi, size)]
        if layer_id in self.grads_streamed:  # several ranks: the parts this rank owns, into the update
            for (a, b), flag in zip(mine, finite):
                for x in range(a, b, size):
                    self._stage((x - lo, min(b, x + size) - lo), piece,
                                lambda staged, p, q, flag=flag: self._into_update(layer_id, staged, p + lo, q + lo,
                                                                                 flag))
            return
        self._piece_tasks.setdefault(layer_id, len(self._pending))
        if self._first and not add:
            self.wait_updated(layer_id)  # the last update still reads this gradient
            for a, b in mine:
                self._copy_down(target[at(a, b)], piece[a - lo : b - lo])
        else:
            for a, b in mine:
                self._stage((a - lo, b - lo), piece, lambda staged, x, y: target[at(x + lo, y + lo)].add_(staged))

    def gradient_done(self, layer_id: int, local_sumsq: torch.Tensor | None) -> None:
        """Every piece of a vocabulary-streamed layer's gradient is on its way: the CPU reduction passes
        the turn to the next rank; the GPU reduction keeps the sum of squares (on the device) of the
        reduced parts this rank owns for the norm (with one rank, `local_sumsq`: all pieces), and early
        updates learn when the gradient has landed."""
        if layer_id in self.grads_streamed:  # already on its way into the update
            if self.world_size > 1:
                local_sumsq = self._piece_sumsq.pop(layer_id, None)
            if local_sumsq is not None:
                self._device_sumsq[layer_id] = local_sumsq
            self._streamed_done(layer_id)
            return
        if self.reduction[layer_id] == "cpu":  # every piece took its turn; as many in every pass
            pieces = self._piece_index.pop(layer_id, 0)
            if self._pieces_per_pass.setdefault(layer_id, pieces) != pieces:
                raise RuntimeError(f"layer {layer_id}: {pieces} gradient pieces in this pass, "
                                   f"{self._pieces_per_pass[layer_id]} in the first")
            return
        if self.world_size > 1:
            local_sumsq = self._piece_sumsq.pop(layer_id, None)
        if local_sumsq is not None and layer_id not in self._host_norm:
            self._device_sumsq[layer_id] = local_sumsq
        first_task = self._piece_tasks.pop(layer_id, len(self._pending))
        if self._first:
            self._guards.append(self.streams.record("d2h"))
        self._landing(layer_id, self._guards[-1] if self._first else None, self._pending[first_task:])

    def gradient(self, layer_id: int, acc: torch.Tensor, local_sumsq: torch.Tensor | None) -> None:
        """This rank's fp32 gradient of the layer for this pass (`acc`, on the device, ready on the
        D2H stream) into the host gradient, by the layer's reduction route."""
        if acc.is_cuda:  # every route reads it on the D2H stream: the compute stream must not reuse its
            acc.record_stream(self.streams.d2h)  # memory (its next gradient's buffer) before those reads ran
        if self.device_state is not None and layer_id in self.device_state:
            self._device_gradient(layer_id, acc, local_sumsq)
            return
        if layer_id in self.grads_streamed:
            self._stream_gradient(layer_id, acc, local_sumsq)
            return
        target = self.host.layers[layer_id].grad
        at = self.host.layers[layer_id].at
        chunks = self.chunks[layer_id]
        if self.reduction[layer_id] == "cpu":
            ticket = self.passes * self.world_size + self.rank
            overwrite = self._first and self.rank == 0
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                self._stage(chunk, acc, lambda staged, lo, hi, last=last: self._add_in_turn(
                    layer_id, target[at(lo, hi)], staged, ticket, overwrite, last))
            return
        owned = self.owned(layer_id)
        if self.world_size > 1:
            with self.streams.on("d2h"):
                for (lo, hi), owner in zip(chunks, self.owners[layer_id]):
                    self.comm.reduce_(acc[lo:hi], owner)
                local_sumsq = sum(torch.dot(acc[lo:hi], acc[lo:hi]) for lo, hi in owned) if owned else None
        if local_sumsq is not None:
            self._device_sumsq[layer_id] = local_sumsq
        if self._first:
            self.wait_updated(layer_id)  # the last update still reads this gradient
            for lo, hi in owned:
                self._copy_down(target[at(lo, hi)], acc[lo:hi])
            self._guards.append(self.streams.record("d2h"))
            self._landing(layer_id, self._guards[-1], [])
            return
        first_task = len(self._pending)
        for chunk in owned:
            self._stage(chunk, acc, lambda staged, lo, hi: target[at(lo, hi)].add_(staged))
        self._landing(layer_id, None, self._pending[first_task:])

    def _landing(self, layer_id: int, event, tasks: list[Future]) -> None:
        """Tell this step's early updates how to wait for the layer's whole gradient on the host
        (one rank: the last pass's copy or host-side adds are all there is)."""
        if self.early is None or not self._last:
            return

        def wait() -> None:
            if event is not None:
                event.synchronize()
            for task in tasks:
                task.result()

        self.early.land(layer_id, wait)

    def _device_gradient(self, layer_id: int, acc: torch.Tensor, local_sumsq: torch.Tensor | None) -> None:
        """The gradient of a layer whose state lives on the device: summed over the ranks there, into
        its buffer (cast on the D2H stream like the host's copy), added to it in a later pass."""
        d = self.device_state.layers[layer_id]
        target = d.grad
        if self.device_state.sharded:
            self._device_gradient_sharded(layer_id, d, acc)
            return
        if self.world_size > 1:
            with self.streams.on("d2h"):
                self.comm.all_reduce_(acc)
                local_sumsq = torch.dot(acc, acc)
                if acc.is_cuda:
                    acc.record_stream(self.streams.d2h)
        if local_sumsq is not None:
            self._device_sumsq[layer_id] = local_sumsq
        if self._first:
            self.streams.wait("d2h", self.device_state.ready.get(layer_id))  # the last update read it
            self.streams.copy("d2h", target, acc)
        else:
            with self.streams.on("d2h"):
                target.add_(acc.to(target.dtype))
                if acc.is_cuda:
                    acc.record_stream(self.streams.d2h)  # not reused before this add has run
        self._guards.append(self.streams.record("d2h"))

    def _device_gradient_sharded(self, layer_id: int, d, acc: torch.Tensor) -> None:
        """Each chunk's gradient summed onto its owner (on the D2H stream), into the owner's buffer
        (cast like the host's copy; added to it in a later pass); this rank's chunks counted in the norm."""
        owned = self.owned(layer_id)
        with self.streams.on("d2h"):
            for (lo, hi), owner in zip(self.chunks[layer_id], self.owners[layer_id]):
                self.comm.reduce_(acc[lo:hi], owner)
            if owned:
                self._device_sumsq[layer_id] = sum(torch.dot(acc[lo:hi], acc[lo:hi]) for lo, hi in owned)
        if self._first:
            self.streams.wait("d2h", self.device_state.ready.get(layer_id))  # the last update read it
        with self.streams.on("d2h"):
            for lo, hi in owned:
                off = d.at(lo, hi)
                if self._first:
                    d.grad[off:off + hi - lo].copy_(acc[lo:hi])
                else:
                    d.grad[off:off + hi - lo].add_(acc[lo:hi].to(d.grad.dtype))
            if acc.is_cuda:
                acc.record_stream(self.streams.d2h)  # not reused before these copies have run
        self._guards.append(self.streams.record("d2h"))

    def _stream_gradient(self, layer_id: int, acc: torch.Tensor, local_sumsq: torch.Tensor | None) -> None:
        """A layer's gradient into its update (plan.streamed_gradients): with several ranks each chunk
        summed onto its owner first (the GPU reduction: the plan streams no gradient the CPUs sum),
        then every chunk this rank owns staged and applied as it lands."""
        owned = self.owned(layer_id)
        if self.world_size > 1:
            with self.streams.on("d2h"):
                for (lo, hi), owner in zip(self.chunks[layer_id], self.owners[layer_id]):
                    self.comm.reduce_(acc[lo:hi], owner)
                local_sumsq = sum(torch.dot(acc[lo:hi], acc[lo:hi]) for lo, hi in owned) if owned else None
        if local_sumsq is not None:
            self._device_sumsq[layer_id] = local_sumsq
        finite = self._finite_flag(local_sumsq)
        for chunk in owned:
            self._stage(chunk, acc, lambda staged, lo, hi: self._into_update(layer_id, staged, lo, hi, finite))
        self._streamed_done(layer_id)

    def _finite_flag(self, sumsq: torch.Tensor | None) -> torch.Tensor | None:
        """Whether the sum of squares of the gradient this rank applies is finite (then so is every
        element; where it overflows, the step's norm does too and the step stops), copied on the D2H
        stream to the host ahead of the chunks it covers, so the update reads it there instead of
        checking each landed chunk on the host. None: no sum (the update checks the chunks)."""
        if sumsq is None:
            return None
        if not self.streams.cuda:
            return torch.isfinite(sumsq).cpu()
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        with self.streams.on("d2h"):
            flag.copy_(torch.isfinite(sumsq), non_blocking=True)
        return flag

    def _streamed_done(self, layer_id: int) -> None:
        """Every part of a streamed gradient this rank owns is on its way into the update: with step
        flags (worker processes), mark the layer updated for the coming round once they are applied
        (the next step's loads wait for every rank's mark)."""
        if self.flags is not None:
            self._pending.append(self._reducer.submit(
                lambda: self.flags.mark_updated(self.rank, layer_id, self.rounds + 1)))

    def _into_update(self, layer_id: int, staged: torch.Tensor, lo: int, hi: int,
                     finite: torch.Tensor | None = None) -> None:
        """A streamed gradient's elements [lo, hi), landed in `staged`: into the layer's update (on the
        reducer thread, before the staging buffer is reused), with the device's word on whether the
        layer's gradient is finite (`finite`, landed before `staged`; None: the update checks `staged`)."""
        if self.apply_gradient is not None:
            self.apply_gradient(layer_id, staged, lo, hi, None if finite is None else bool(finite))

    def _copy_down(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """On the D2H stream, cast there when the host gradient is bf16."""
        if dst.dtype != src.dtype:
            with self.streams.on("d2h"):
                if src.is_cuda:  # read by the cast on this stream, not only by the copy (Streams.copy)
                    src.record_stream(self.streams.d2h)
                src = src.to(dst.dtype)
        self.streams.copy("d2h", dst, src)

    def _stage(self, chunk: tuple[int, int], acc: torch.Tensor, add) -> None:
        """Copy one chunk of `acc` into a free staging buffer; the reducer thread then runs
        `add(staged, lo, hi)` once the copy has landed, and frees the buffer."""
        lo, hi = chunk
        slot = self._take_slot()
        staged = self._staging[slot][: hi - lo]
        self._copy_down(staged, acc[lo:hi])
        event = self.streams.record("d2h")

        def task() -> None:
            try:
                if event is not None:
                    event.synchronize()
                add(staged, lo, hi)
            finally:
                self._free.put(slot)

        self._pending.append(self._reducer.submit(task))

    def _take_slot(self) -> int:
        """A free staging buffer (chunk-sized, pinned on CUDA), allocated on first use."""
        if not self._staging:
            self._staging = [torch.empty(self._staging_numel(), dtype=self._grad_dtype, pin_memory=self.streams.cuda)
                             for _ in range(self._staging_slots)]
            for i in range(self._staging_slots):
                self._free.put(i)
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                self._raise_if_failed()

    def _staging_numel(self) -> int:
        """Elements of one staging buffer: the largest chunk of a host layer (costmodel.memory.host_staging_bytes
        counts these buffers)."""
        return max(hi - lo for i, chunks in self.chunks.items() if i not in self._on_device for lo, hi in chunks)

    def _add_in_turn(self, layer_id, target, staged, ticket, overwrite, last) -> None:
        """CPU reduction: add (or, for the first contribution of a step, copy) in rank order."""
        self.flags.wait_turn(layer_id, ticket)
        if overwrite:
            self.wait_updated(layer_id)
            target.copy_(staged)
        else:
            target.add_(staged)
        if last:
            self.flags.advance(layer_id, ticket)

    def _pass_turn(self, layer_id: int, ticket: int) -> None:
        """CPU reduction of a contribution with nothing to add: the turn passes on in rank order."""
        self.flags.wait_turn(layer_id, ticket)
        self.flags.advance(layer_id, ticket)

    def _raise_if_failed(self) -> None:
        for f in self._pending:
            if f.done() and f.exception() is not None:
                raise f.exception()
        if self.flags is not None:
            self.flags.on_wait()

    def end_pass(self) -> None:
        self.passes += 1

    def finish(self, n_passes: int) -> torch.Tensor:
        """After the last pass: wait until this rank's contributions are on the host, then (with
        several ranks, after a barrier) this rank's share of the gradient's sum of squares (fp64)."""
        for event in self._guards:
            if event is not None:
                event.synchronize()
        self._guards = []
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        if self.comm is not None:
            self.comm.barrier()
        device, host = [], 0.0
        for layer_id in self.chunks:
            on_device = self.device_state is not None and layer_id in self.device_state
            sharded = on_device and self.device_state.sharded
            if on_device and self.rank > 0 and not sharded:  # every rank holds the same sum: counted once
                continue
            if n_passes == 1 and layer_id in self._device_sumsq:
                device.append(self._device_sumsq[layer_id].float())
            elif on_device:
                grad = self.device_state.layers[layer_id].grad  # sharded: this rank's chunks
                if grad.numel():
                    device.append(torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2)
            else:
                arrays = self.host.layers[layer_id]
                host += sum(_sumsq(arrays.grad[arrays.at(lo, hi)]) for lo, hi in self.owned(layer_id))
        total = torch.tensor(host, dtype=torch.float64)
        if device:
            total += torch.stack(device).double().sum().cpu()
        return total

    def close(self) -> None:
        self._reducer.shutdown(wait=True)
        self._staging = []


def _sumsq(t: torch.Tensor, piece: int = 1 << 24) -> float:
    """Sum of squares of a host tensor, in fp32 pieces summed in fp64 (no full-size temporary)."""
    return sum(float(torch.linalg.vector_norm(t[i : i + piece], dtype=torch.float32)) ** 2
               for i in range(0, t.numel(), piece))
