"""The prologue (embeddings, masks, rotary tables): the model's own forward stopped at the last block.

Its forward, per micro-batch, records every block's arguments and the first hidden state; its
backward takes its weights' gradients from the first block's input gradient, the embedding tables'
in one fp32 embedding backward over every micro-batch (embedding_grads.py). A streamed embedding
table (vocab_stream.py) is read chunk by chunk before the forward and its gradient is made and
sent down chunk by chunk in the backward.
"""

from __future__ import annotations

import torch
from torch import nn

from slidedp.backend.runtime.pass_state import PassState, model_kwargs
from slidedp.backend.runtime.weight_slots import WeightWindow
from slidedp.ir.blocks import BlockCall, StopForward, proxied_blocks, wrap_block_output
from slidedp.ir.graph import LayerGraph


class Prologue:
    """Forward and backward of the prologue, with the model's blocks proxied."""

    def __init__(self, model: nn.Module, graph: LayerGraph, weights: WeightWindow, n_blocks: int):
        self.model, self.graph, self.weights, self.n_blocks = model, graph, weights, n_blocks

    def forward(self, st: PassState) -> None:
        """The model's forward up to the last block, per micro-batch: records every block's inputs."""
        self.weights.ensure_resident(self.graph.prologue.id)
        table = self.weights.vocab.get(self.graph.prologue.id)
        if table is not None:  # every micro-batch's rows first, each chunk loaded once (vocab_stream.py)
            ids = [mb.input_ids for mb in st.micro_batches]
            outs = dict(zip(map(id, ids), self.weights.vocab_stream.embed(table, ids)))
            stream = self.weights.vocab_stream
            st.embedding_grads.lookup[id(st.leaves[table.name])] = (
                lambda x: outs[id(x)] if id(x) in outs else stream.embed(table, [x])[0])
        with st.embedding_grads:
            self._forward(st)
        if table is not None and id(st.leaves[table.name]) not in st.embedding_grads.used:
            raise RuntimeError(f"the model's forward does not read {table.name} by F.embedding: its table cannot "
                               "stream by vocabulary chunk (plan it resident: SolverOptions(vocab_streamed=()))")
        st.h0 = [c[0].hidden for c in st.calls]
        st.hidden = [h.detach() for h in st.h0]

    def _forward(self, st: PassState) -> None:
        g = self.graph
        for mb in st.micro_batches:
            recorded: list[BlockCall] = []

            def capture(index: int, call: BlockCall, recorded=recorded):
                recorded.append(call)
                if index == self.n_blocks - 1:
                    raise StopForward
                return wrap_block_output(call.hidden, g.block_output)

            with proxied_blocks(self.model, g.blocks_path, capture):
                try:
                    torch.func.functional_call(self.model, st.top, (mb.input_ids,), model_kwargs(g.forward_kwargs, mb))
                except StopForward:
                    pass
            st.calls.append(recorded)

    def backward(self, st: PassState) -> None:
        """The prologue's weight gradients from each micro-batch's first-block input gradient."""
        names = [p.name for p in self.graph.prologue.params]
        if names:
            for m, h in enumerate(st.h0):
                if h.requires_grad:
                    grads = torch.autograd.grad(h, [st.leaves[n] for n in names], st.grad_h[m], allow_unused=True)
                    st.grads.accumulate(names, grads)
            st.embedding_grads.accumulate()
            self._streamed_backward(st)
        st.grads.finish_resident(self.graph.prologue.id)

    def _streamed_backward(self, st: PassState) -> None:
        """A streamed embedding table's gradient, chunk by chunk, each sent down as it is made (a tied
        table's added to the head's, which the epilogue sent first)."""
        lid = self.graph.prologue.id
        table = self.weights.vocab.get(lid)
        if table is None:
            return
        eg = st.embedding_grads
        key = id(st.leaves[table.name])
        send = lambda r0, r1, grad: st.grads.send_vocab_chunk(self.weights.routes, self.weights.streams, lid, r0, r1,
                                                             grad, add=table.tied)
        self.weights.vocab_stream.embedding_backward(table, eg.records.pop(key, []), eg.padding.get(key, -1), send)
