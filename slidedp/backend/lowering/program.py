"""The Program: one pass over the weights as ordered operations on streams, with events.

`lower(graph, schedule)` turns a plan's schedule (window, activation policy and chunks per layer) into
a flat list of `Op`s in issue order. Each op runs on one stream, waits for events recorded by
earlier ops and may record one event; `alloc`/`free` ops describe the device buffers and their
sizes (from the IR's cost figures), so a simulator can check the program without running it
(`slidedp.backend.lowering.verify`) and the executor can run it (`slidedp.backend.runtime.executor`).

Streams: "compute", "h2d", "d2h". Event ids are small integers, unique in a program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slidedp.backend.lowering.weight_window import schedule_window
from slidedp.costmodel import memory as mem
from slidedp.costmodel.memory import DTYPE_BYTES, chunk_bounds
from slidedp.ir.graph import BLOCK, LayerGraph
from slidedp.scheduler.plan import BLOCK_ACTIVATIONS, RECOMPUTED_ACTIVATIONS, Schedule, input_offloaded

# op kinds
PROLOGUE, FWD, EPILOGUE, BWD, PROLOGUE_BWD = "prologue", "fwd", "epilogue", "bwd", "prologue_bwd"
H2D_WEIGHTS, D2H_GRAD, ALLOC, FREE = "h2d_weights", "d2h_grad", "alloc", "free"
# a recompute_offload block's input of every micro-batch: to the host after its forward, back before its backward
D2H_INPUT, H2D_INPUT = "d2h_input", "h2d_input"
# an offload block's saved activations of every micro-batch: their copies down (enqueued by its forward) have
# landed; back to the device before its backward
D2H_SAVED, H2D_SAVED = "d2h_saved", "h2d_saved"


@dataclass(frozen=True)
class Op:
    index: int
    stream: str
    kind: str
    layer_id: int = -1
    block: int = -1  # block index (0..N-1) for block ops
    slot: int = -1  # weight slot read or written
    chunks: tuple[tuple[int, int], ...] = ()  # element ranges moved by a copy
    policy: str = ""  # fwd/bwd: recompute | keep | offload | recompute_offload
    waits: tuple[int, ...] = ()
    record: int | None = None
    buffer: str = ""  # alloc/free: buffer name
    nbytes: int = 0  # alloc: size

    def text(self) -> str:
        what = {
            ALLOC: f"alloc {self.buffer} {self.nbytes:,} B",
            FREE: f"free {self.buffer}",
        }.get(self.kind, f"{self.kind} L{self.layer_id}" + (f" slot{self.slot}" if self.slot >= 0 else ""))
        if self.policy:
            what += f" [{self.policy}]"
        if self.chunks and len(self.chunks) > 1:
            what += f" x{len(self.chunks)} chunks"
        waits = f" wait{list(self.waits)}" if self.waits else ""
        rec = f" -> e{self.record}" if self.record is not None else ""
        return f"{self.index:>5} {self.stream:<8} {what}{waits}{rec}"


@dataclass(frozen=True)
class Program:
    ops: tuple[Op, ...]
    n_slots: int
    persistent_bytes: int  # resident weights and gradients, weight slots, gradient accumulators and staging
    notes: tuple[str, ...] = field(default_factory=tuple)
    vocab_streamed: tuple[int, ...] = ()  # prologue / epilogue whose vocabulary table streams (vocab_stream.py)
    vocab_chunk_rows: int = 0

    def text(self) -> str:
        return "\n".join(op.text() for op in self.ops)


def _device_state_numel(layer, schedule: Schedule) -> int:
    """Parameters of a device-state layer the busiest rank keeps: its owned chunks when sharded."""
    if not schedule.device_state_sharded:
        return layer.numel
    d = schedule.decisions[layer.id]
    owned: dict[int, int] = {}
    for c, (lo, hi) in enumerate(chunk_bounds(layer.numel, d.chunks)):
        owner = d.owners[c] if c < len(d.owners) else 0
        owned[owner] = owned.get(owner, 0) + hi - lo
    return max(owned.values())


class _Builder:
    def __init__(self):
        self.ops: list[Op] = []
        self.next_event = 0

    def event(self) -> int:
        self.next_event += 1
        return self.next_event - 1

    def add(self, stream: str, kind: str, record: bool = False, **kw) -> Op:
        op = Op(index=len(self.ops), stream=stream, kind=kind, record=self.event() if record else None, **kw)
        self.ops.append(op)
        return op


def lower(graph: LayerGraph, schedule: Schedule, *, micro_batches: int) -> Program:
    """The ops of one pass of `micro_batches` micro-batches under `schedule`; see the executor for
    their semantics.

    Buffer sizes come from the same costmodel.memory functions as the scheduler's footprint
    (scheduler/problem/footprint.py), so the simulated peak of a lowered plan stays within its prediction.
    `schedule.loss_chunk_tokens` (0: the whole micro-batch) bounds the epilogue's logits. The blocks of
    `schedule.device_state` keep their optimizer state on the device: their weight "loads" and gradient
    "copies" stay within the device (the same ops, on the same streams), their state is persistent;
    streamed updates (`schedule.streamed_updates`) add their slots, also persistent. A prologue or
    epilogue whose activation is "streamed" keeps its vocabulary table off the device: its chunk
    buffers are allocated around its ops (costmodel.memory.vocab_stream_bytes).
    """
    window, loss_chunk_tokens, device_state = schedule.window, schedule.loss_chunk_tokens, schedule.device_state
    activation = {d.layer_id: d.activation for d in schedule.decisions if d.kind == BLOCK}
    chunks = {d.layer_id: d.chunks for d in schedule.decisions}
    streamed = bool(schedule.streamed_updates)
    c = DTYPE_BYTES[graph.compute_dtype]
    vocab = tuple(d.layer_id for d in schedule.decisions if d.kind != BLOCK and d.activation == "streamed")
    rows = min(schedule.vocab_chunk_rows, graph.vocab_size)
    vocab_bytes = mem.vocab_stream_bytes(rows, graph.hidden_size, c) if vocab else 0
    blocks = [layer for layer in graph.layers if layer.kind == BLOCK]
    unknown = {activation.get(layer.id, "recompute") for layer in blocks} - set(BLOCK_ACTIVATIONS)
    if unknown:
        raise ValueError(f"unknown activation policy {sorted(unknown)}: one of {', '.join(BLOCK_ACTIVATIONS)}")
    n = len(blocks)
    sched = schedule_window(n, window, schedule.window_loads)
    b = _Builder()
    epi = graph.epilogue
    max_block = max(layer.numel for layer in blocks)
    persistent = (sum(mem.resident_layer_bytes(graph.edge_resident_numel(vocab), c))
                  + mem.weight_slots_bytes(max_block, c, window) + mem.grad_accumulators_bytes(max_block)
                  + max((mem.grad_staging_bytes(layer.numel, c, chunks.get(layer.id, 1), 1, "cpu")
                         for layer in graph.layers if layer.id not in device_state and layer.id not in vocab),
                        default=0)  # cast in place there; a streamed table's casts are in its own buffers
                  + sum(mem.device_state_bytes(_device_state_numel(layer, schedule), c)
                        for layer in graph.layers if layer.id in device_state)
                  + mem.device_update_piece_bytes(_device_state_numel(layer, schedule)
                                                  for layer in graph.layers if layer.id in device_state)
                  + (mem.streamed_update_bytes(c) if streamed else 0))
    tokens = graph.batch_size * graph.seq_len
    if epi.id in vocab:
        epilogue_bytes = mem.streamed_epilogue_working_bytes(tokens, graph.hidden_size, rows, c,
                                                             loss_chunk_tokens or tokens, micro_batches) + vocab_bytes
    else:
        epilogue_bytes = mem.epilogue_working_bytes(tokens, graph.hidden_size, graph.vocab_size, c,
                                                    loss_chunk_tokens or tokens, fused=graph.linear_head)
    edge_policy = {layer_id: "streamed" for layer_id in vocab}
    pro = graph.prologue.id
    table = graph.prologue.vocab_param(graph.vocab_size) if pro in vocab else None
    prologue_bwd_bytes = mem.prologue_backward_bytes(graph.prologue.params, micro_batches, tokens,
                                                     table.name if table is not None else None, rows)
    if pro in vocab:
        b.add("compute", ALLOC, buffer="vocab[prologue]", nbytes=vocab_bytes)
    b.add("compute", PROLOGUE, layer_id=pro, policy=edge_policy.get(pro, ""))
    if pro in vocab:
        b.add("compute", FREE, buffer="vocab[prologue]")
    slot_ready: list[int | None] = [None] * window
    slot_free: list[int | None] = [None] * window
    pending = list(sched.loads)

    def issue_loads(after_position: int) -> None:
        while pending and pending[0].issue_after <= after_position:
            load = pending.pop(0)
            layer = blocks[load.block]
            waits = (slot_free[load.slot],) if slot_free[load.slot] is not None else ()
            op = b.add("h2d", H2D_WEIGHTS, record=True, layer_id=layer.id, block=load.block, slot=load.slot,
                       chunks=chunk_bounds(layer.numel, chunks.get(layer.id, 1)), waits=waits)
            slot_ready[load.slot] = op.record

    issue_loads(-1)
    # Offloaded block inputs (scheduler/problem/footprint.py): block k's goes down after its forward,
    # its device copy is freed before the forward two blocks later (or the epilogue) once the copy has
    # landed, and comes back after the compute two positions before its backward (the backward of
    # block k + 2, or the epilogue); not the last block's (on the device throughout anyway).
    # Offloaded activations (policy offload) keep the same transit window: block k's saved tensors go
    # down during its forward, are freed before the forward two blocks later once their copies have
    # landed (the last block's stay), and come back by the same rule as an input.
    offloaded = {k for k, layer in enumerate(blocks[:-1]) if input_offloaded(activation, layer.id)}
    saved_offloaded = {k for k, layer in enumerate(blocks) if activation.get(layer.id) == "offload"}
    input_down: dict[int, int] = {}  # block -> event of its input's (or saved activations') copy to the host
    input_up: dict[int, int] = {}  # block -> event of its copy back

    def saved_bytes(k: int) -> int:
        return blocks[k].costs.saved_activation_bytes * micro_batches

    def free_input(k: int) -> None:
        if k in offloaded:
            b.add("compute", FREE, buffer=f"act[{k}]", waits=(input_down[k],))
        if k in saved_offloaded and k < n - 1:
            b.add("compute", FREE, buffer=f"saved[{k}]", waits=(input_down[k],))

    def reload_input(k: int, after: Op) -> None:
        if k in offloaded:
            nbytes = blocks[k].costs.boundary_activation_bytes * micro_batches
            b.add("compute", ALLOC, buffer=f"act[{k}]", nbytes=nbytes)
            up = b.add("h2d", H2D_INPUT, record=True, layer_id=blocks[k].id, block=k,
                       waits=(after.record, input_down[k]))
            input_up[k] = up.record
        if k in saved_offloaded:
            if k < n - 1:
                b.add("compute", ALLOC, buffer=f"saved[{k}]", nbytes=saved_bytes(k))
            up = b.add("h2d", H2D_SAVED, record=True, layer_id=blocks[k].id, block=k,
                       waits=(after.record, input_down[k]))
            input_up[k] = up.record

    grad_events: dict[int, int] = {}
    drains: list[int] = []  # events of the blocks' gradient copies, in backward order
    for position, k in enumerate(sched.sequence):
        layer = blocks[k]
        slot = sched.slot_of[position]
        policy = activation.get(layer.id, "recompute")
        waits = (slot_ready[slot],)
        costs = layer.costs
        if position < n:
            keep_bytes = costs.saved_activation_bytes if policy == "keep" else costs.boundary_activation_bytes
            free_input(k - 2)
            b.add("compute", ALLOC, buffer=f"act[{k}]", nbytes=keep_bytes * micro_batches)
            b.add("compute", ALLOC, buffer=f"work[{k}]", nbytes=costs.peak_workspace_bytes)
            if k in saved_offloaded:
                b.add("compute", ALLOC, buffer=f"saved[{k}]", nbytes=saved_bytes(k))
            op = b.add("compute", FWD, record=True, layer_id=layer.id, block=k, slot=slot, policy=policy, waits=waits)
            b.add("compute", FREE, buffer=f"work[{k}]")
            if k in offloaded or k in saved_offloaded:
                input_down[k] = b.add("d2h", D2H_INPUT if k in offloaded else D2H_SAVED, record=True,
                                      layer_id=layer.id, block=k, waits=(op.record,)).record
            if position == n - 1:
                free_input(n - 2)
                b.add("compute", ALLOC, buffer="grad_hidden", nbytes=costs.boundary_activation_bytes * micro_batches)
                b.add("compute", ALLOC, buffer="epilogue", nbytes=epilogue_bytes)
                head = b.add("compute", EPILOGUE, record=True, layer_id=epi.id, policy=edge_policy.get(epi.id, ""))
                b.add("compute", FREE, buffer="epilogue")
                # the epilogue's own gradient is whole after its op (a tied head's is the prologue's)
                d2h = b.add("d2h", D2H_GRAD, record=True, layer_id=epi.id, waits=(head.record,),
                            chunks=chunk_bounds(epi.numel, chunks.get(epi.id, 1)))
                grad_events[epi.id] = d2h.record
        else:
            work = (costs.peak_workspace_bytes + mem.param_grads_bytes(layer.numel, c)
                    + (costs.saved_activation_bytes if policy in RECOMPUTED_ACTIVATIONS else 0))
            b.add("compute", ALLOC, buffer=f"work[{k}]", nbytes=work)
            waits += (input_up[k],) if k in offloaded or k in saved_offloaded else ()
            # the plan has GRAD_ACCUMULATORS block gradients on the device: this one's buffer is the one
            # drained GRAD_ACCUMULATORS backwards earlier (backend/runtime/grad_buffers.py)
            waits += (drains[-mem.GRAD_ACCUMULATORS],) if len(drains) >= mem.GRAD_ACCUMULATORS else ()
            op = b.add("compute", BWD, record=True, layer_id=layer.id, block=k, slot=slot, policy=policy, waits=waits)
            b.add("compute", FREE, buffer=f"work[{k}]")
            b.add("compute", FREE, buffer=f"act[{k}]")
            if k in saved_offloaded:
                b.add("compute", FREE, buffer=f"saved[{k}]")
            d2h = b.add("d2h", D2H_GRAD, record=True, layer_id=layer.id, waits=(op.record,),
                        chunks=chunk_bounds(layer.numel, chunks.get(layer.id, 1)))
            grad_events[layer.id] = d2h.record
            drains.append(d2h.record)
        slot_free[slot] = op.record
        issue_loads(position)
        if position == n - 1:
            reload_input(n - 1, op)  # the last block's saved activations, once down (its input stays)
            reload_input(n - 2, head)
        elif position >= n:
            reload_input(k - 2, op)
    if pro in vocab:
        b.add("compute", ALLOC, buffer="vocab[prologue]", nbytes=vocab_bytes)
    b.add("compute", ALLOC, buffer="work[prologue]", nbytes=prologue_bwd_bytes)
    last = b.add("compute", PROLOGUE_BWD, record=True, layer_id=pro, policy=edge_policy.get(pro, ""))
    b.add("compute", FREE, buffer="work[prologue]")
    if pro in vocab:
        b.add("compute", FREE, buffer="vocab[prologue]")
    b.add("compute", FREE, buffer="grad_hidden")
    d2h = b.add("d2h", D2H_GRAD, record=True, layer_id=graph.prologue.id, waits=(last.record,),
                chunks=chunk_bounds(graph.prologue.numel, chunks.get(graph.prologue.id, 1)))
    grad_events[graph.prologue.id] = d2h.record
    return Program(ops=tuple(b.ops), n_slots=window, persistent_bytes=persistent,
                   notes=(f"{sched.n_loads} weight loads for {n} blocks with window {window}",),
                   vocab_streamed=vocab, vocab_chunk_rows=rows if vocab else 0)
