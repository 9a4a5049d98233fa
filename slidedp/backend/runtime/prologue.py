"""The prologue (embeddings, masks, rotary tables): the model's own forward stopped at the last block.

Its forward, per micro-batch, records every block's arguments and the first hidden state; its
backward takes its weights' gradients from the first block's input gradient, the embedding tables'
in one fp32 embedding backward over every micro-batch (embedding_grads.py).
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
        with st.embedding_grads:
            self._forward(st)
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
        st.grads.finish_resident(self.graph.prologue.id)
