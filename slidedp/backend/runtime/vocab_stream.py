"""Vocabulary-streamed prologue and epilogue: the [vocab, hidden] table crosses in row chunks.

A plan may stream the embedding table, the head, or the one table they tie, instead of keeping it
on the device for the whole step with an fp32 gradient of the whole table (docs/design.md §4.14;
decided per layer, `LayerDecision.activation == "streamed"`, `Schedule.vocab_chunk_rows` rows per
chunk). The chunks
go through two device slots (chunk j + 1 loads while chunk j computes), and each chunk's fp32
weight gradient goes down to the host gradient as soon as it is made (`Routes.gradient_piece`);
the layer's other parameters (final norm, position embeddings) stay resident, as before.

- Embedding: the forward loads each chunk once per pass and copies out the rows of the tokens that
  fall in it, for every micro-batch; the backward needs no weights: per chunk, PyTorch's embedding
  backward over that chunk's tokens (fp32, padding row excluded as `F.embedding` defines it).
- Head: the forward loads each chunk once per pass and folds its logits into a running logsumexp
  and target logit per token (the linear + cross-entropy kernels of one chunk,
  kernels/linear_cross_entropy.py, with chunk-local labels); the backward loads each chunk again,
  recomputes its logits, and from the whole logsumexp makes the chunk's weight gradient and its
  part of the hidden-state gradient (summed in fp32 over the chunks). Nothing of [tokens, vocab]
  is ever whole on the device.
A tied table streams for both uses: its chunks are loaded for the embedding and again for the head,
and the embedding's chunk gradients are added on the host to the head's, sent down before them
(`Routes.gradient_piece(add=True)`), so the one host gradient is their sum before the one update.
The host update is unchanged: AdamW of the whole table (every row, as torch.optim.AdamW does),
so a step is the same AdamW step as with the resident table, up to the order of fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.backend.kernels.linear_cross_entropy import IGNORE_INDEX, vocab_chunk_backward, vocab_chunk_forward
from slidedp.backend.runtime.routes import Routes
from slidedp.backend.runtime.streams import Streams
from slidedp.costmodel.memory import VOCAB_GRAD_BUFFERS


@dataclass(frozen=True)
class VocabTable:
    """A streamed table: the layer that stores it, parameter name, offset in that layer's flat host
    arrays, shape and chunking. `tied`: one table of the prologue and the epilogue (stored by the
    prologue), whose host gradient is the head's, sent down first, plus the embedding's, added to it."""

    layer_id: int
    name: str
    start: int
    rows: int
    hidden: int
    chunk_rows: int
    tied: bool = False

    def chunks(self) -> list[tuple[int, int]]:
        return [(r0, min(self.rows, r0 + self.chunk_rows)) for r0 in range(0, self.rows, self.chunk_rows)]

    def flat(self, r0: int, r1: int) -> tuple[int, int]:
        """The chunk's element range in the layer's flat host arrays."""
        return self.start + r0 * self.hidden, self.start + r1 * self.hidden


class VocabStream:
    """Loads a table's chunks through two device slots (created per use, freed after it)."""

    def __init__(self, host, routes: Routes, streams: Streams, *, device: torch.device, dtype: torch.dtype):
        self.host, self.routes, self.streams = host, routes, streams
        self.device, self.dtype = device, dtype

    def chunks(self, table: VocabTable):
        """Yields (r0, r1, weight [r1 - r0, hidden] on the device, ready on the compute stream); the
        next chunk's load is issued before the current one is handed out."""
        bounds = table.chunks()
        size = table.chunk_rows * table.hidden
        slots = [torch.empty(size, dtype=self.dtype, device=self.device) for _ in range(min(2, len(bounds)))]
        free: list = [None] * len(slots)
        ready: list = [None] * len(bounds)

        def issue(j: int) -> None:
            s = j % len(slots)
            self.streams.wait("h2d", free[s])  # the chunk before in this slot has been computed with
            lo, hi = table.flat(*bounds[j])
            self.routes.load_range(table.layer_id, slots[s][: hi - lo], lo, hi)
            ready[j] = self.streams.record("h2d")

        issue(0)
        for j, (r0, r1) in enumerate(bounds):
            if j + 1 < len(bounds):
                issue(j + 1)
            self.streams.wait("compute", ready[j])
            s = j % len(slots)
            yield r0, r1, slots[s][: (r1 - r0) * table.hidden].view(r1 - r0, table.hidden)
            free[s] = self.streams.record("compute")

    # -- embedding --------------------------------------------------------------------------------
    def embed(self, table: VocabTable, ids_list: list[torch.Tensor]) -> list[torch.Tensor]:
        """F.embedding(ids, table) for each tensor of ids, with each chunk loaded once for all."""
        outs = [torch.empty(*ids.shape, table.hidden, dtype=self.dtype, device=self.device) for ids in ids_list]
        for r0, r1, w in self.chunks(table):
            for ids, out in zip(ids_list, outs):
                hit = (ids >= r0) & (ids < r1)
                out[hit] = w[ids[hit] - r0]
        return outs

    def embedding_backward(self, table: VocabTable, records, padding_idx: int, send) -> None:
        """Per chunk, the fp32 weight gradient of the recorded (ids, output gradient) pairs of every
        micro-batch, handed to `send(r0, r1, grad)` as soon as it is made."""
        done = [(ids.reshape(-1), g.reshape(-1, table.hidden)) for ids, g in records if g is not None]
        grads = self._grad_buffers(table)
        for r0, r1 in table.chunks():
            grad = grads.take(r1 - r0)
            pad = padding_idx - r0 if r0 <= padding_idx < r1 else -1
            for ids, g in done:
                hit = (ids >= r0) & (ids < r1)
                if bool(hit.any()):
                    grad += torch.ops.aten.embedding_dense_backward(g[hit].float(), ids[hit] - r0, r1 - r0, pad, False)
            send(r0, r1, grad)
            grads.sent()

    # -- head and loss ----------------------------------------------------------------------------
    def head_loss(self, table: VocabTable, hidden: list[torch.Tensor], labels: list[torch.Tensor], *,
                  scale: float, chunk_tokens: int | None, send) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Token cross-entropy of logits = hidden[m] @ table.T for every micro-batch m (hidden [T, H],
        labels [T] shifted, -100 ignored), summed and times `scale`; returns the loss (fp32) and each
        hidden's gradient (fp32); each chunk's fp32 weight gradient goes to `send(r0, r1, grad)`."""
        lse = [torch.full((h.shape[0],), float("-inf"), dtype=torch.float32, device=self.device) for h in hidden]
        tgt = [torch.zeros(h.shape[0], dtype=torch.float32, device=self.device) for h in hidden]
        for r0, r1, w in self.chunks(table):
            for m, h in enumerate(hidden):
                local = _local_labels(labels[m], r0, r1)
                lse_c, tgt_c = vocab_chunk_forward(h, w, local, chunk_tokens)
                lse[m] = torch.logaddexp(lse[m], lse_c)
                tgt[m] += torch.where(local != IGNORE_INDEX, tgt_c, 0.0)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        coef = []
        for m, lab in enumerate(labels):
            valid = lab != IGNORE_INDEX
            loss = loss + torch.where(valid, lse[m] - tgt[m], 0.0).sum() * scale
            coef.append(valid.float() * scale)
        grad_hidden = [torch.zeros(h.shape, dtype=torch.float32, device=self.device) for h in hidden]
        grads = self._grad_buffers(table)
        for r0, r1, w in self.chunks(table):
            grad_w = grads.take(r1 - r0)
            for m, h in enumerate(hidden):
                vocab_chunk_backward(h, w, _local_labels(labels[m], r0, r1), lse[m], coef[m], chunk_tokens,
                                     grad_hidden[m], grad_w)
            send(r0, r1, grad_w)
            grads.sent()
        return loss, grad_hidden

    def _grad_buffers(self, table: VocabTable) -> "ChunkGrads":
        return ChunkGrads(self.streams, min(VOCAB_GRAD_BUFFERS, len(table.chunks())),
                          table.chunk_rows, table.hidden, self.device)


class ChunkGrads:
    """A streamed table's chunk gradients, made in `count` fp32 buffers used in turn
    (costmodel.memory.VOCAB_GRAD_BUFFERS). Each chunk's gradient is read by the D2H stream only (its
    copies, casts and reductions: Routes.gradient_piece); before a buffer is zeroed again, the compute
    stream waits for what the D2H stream was given from it. The caching allocator would otherwise keep
    every sent chunk until its copy ran (`record_stream`): with the host adding slower than the device
    makes chunks, most of the table's fp32 gradient at once."""

    def __init__(self, streams: Streams, count: int, rows: int, hidden: int, device: torch.device):
        self.streams, self.rows, self.hidden = streams, rows, hidden
        self.buffers = [torch.empty(rows * hidden, dtype=torch.float32, device=device) for _ in range(max(1, count))]
        self.taken: list = [None] * len(self.buffers)
        self.turn = 0

    def take(self, rows: int) -> torch.Tensor:
        """The next buffer as a zeroed [rows, hidden] fp32 gradient, on the compute stream."""
        if rows > self.rows:
            raise ValueError(f"a chunk of {rows} rows in buffers of {self.rows}")
        s = self.turn % len(self.buffers)
        self.streams.wait("compute", self.taken[s])
        grad = self.buffers[s][: rows * self.hidden].view(rows, self.hidden)
        grad.zero_()
        return grad

    def sent(self) -> None:
        """The buffer just taken has been handed to the D2H stream: its next use waits for this point."""
        self.taken[self.turn % len(self.buffers)] = self.streams.record("d2h")
        self.turn += 1


def _local_labels(labels: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Labels as indices into the chunk [r0, r1); -100 for a label outside it (or ignored)."""
    return torch.where((labels >= r0) & (labels < r1), labels - r0, IGNORE_INDEX)


def vocab_tables(graph, host, streamed_ids, chunk_rows: int) -> dict[int, VocabTable]:
    """The VocabTable of each streamed layer (LayerGraph.vocab_table of the prologue / epilogue; a tied
    table is the same for both)."""
    if frozenset(streamed_ids) not in graph.vocab_sets():
        raise ValueError(f"layers {sorted(streamed_ids)} cannot stream their vocabulary table so (no table that "
                         "can stream, or a tied table for one of its two layers only)")
    out = {}
    for lid in streamed_ids:
        param = graph.vocab_table(lid)
        owner, start = next((layout.layer_id, s) for layout in host.layouts
                            for name, s, _, _ in layout.param_offsets if name == param.name)
        out[lid] = VocabTable(owner, param.name, start, param.shape[0], param.shape[1], max(1, chunk_rows),
                              tied=graph.tied_table is not None)
    return out
