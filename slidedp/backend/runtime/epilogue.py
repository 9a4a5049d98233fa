"""The epilogue: head and token-weighted loss per micro-batch, and the gradient of the last hidden state.

With a plain linear head (see HeadCapture) the loss is a fused linear + cross-entropy over
`loss_chunk_tokens` tokens at a time that never holds the full logits, and the head's weight
gradient goes straight into its fp32 accumulator; otherwise the model's logits are computed and the
loss taken in row chunks. A head that streams by vocabulary chunk (vocab_stream.py) takes the
fused loss chunk by chunk of the vocabulary instead, its weight never whole on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slidedp.backend.kernels.linear_cross_entropy import linear_cross_entropy, next_token_labels
from slidedp.backend.runtime.pass_state import MicroBatch, PassState, model_kwargs
from slidedp.backend.runtime.weight_slots import WeightWindow
from slidedp.ir.blocks import BlockCall, HeadCapture, logits_of, proxied_blocks, wrap_block_output
from slidedp.ir.graph import LayerGraph


class Epilogue:
    """The loss of a pass and its gradients: the epilogue's weights' and the last hidden state's."""

    def __init__(self, model: nn.Module, graph: LayerGraph, weights: WeightWindow, n_blocks: int, *,
                 loss_chunk_tokens: int | None):
        self.model, self.graph, self.weights, self.n_blocks = model, graph, weights, n_blocks
        self.loss_chunk_tokens = loss_chunk_tokens
        self.head = HeadCapture.find(model)  # a plain linear head: the loss is fused (see run)
        self.fused_head: bool | None = None  # known after the first epilogue
        self.names = [p.name for p in graph.epilogue.params] + list(graph.epilogue.tied_param_names)

    def run(self, st: PassState) -> None:
        """Head and token-weighted loss per micro-batch; gradient of the last hidden state (module docstring)."""
        self.weights.ensure_resident(self.graph.epilogue.id)
        if self.graph.epilogue.id in self.weights.vocab:
            self._streamed(st)
            st.grads.finish_resident(self.graph.epilogue.id)
            return
        for m, mb in enumerate(st.micro_batches):
            if self.head is not None and self.fused_head is not False:
                grad = self._fused(st, m, mb)
                if grad is not None:
                    st.hidden[m] = None
                    st.grad_h.append(grad)
                    continue
            rows = mb.input_ids.shape[0]
            tokens = self.loss_chunk_tokens or rows * mb.input_ids.shape[1]
            step = min(rows, max(1, tokens // mb.input_ids.shape[1]))
            grad_parts = []
            for r0 in range(0, rows, step):
                part = MicroBatch(mb.input_ids[r0 : r0 + step], mb.labels[r0 : r0 + step],
                                  None if mb.attention_mask is None else mb.attention_mask[r0 : r0 + step])
                last = st.hidden[m][r0 : r0 + step].detach().requires_grad_(True)
                with torch.enable_grad():
                    logits = logits_of(self._forward(st, part, last))
                    loss = token_loss_sum(logits, part.labels) / st.global_tokens
                    del logits
                grads = torch.autograd.grad(loss, [last] + [st.leaves[n] for n in self.names],
                                            allow_unused=True)
                grad_parts.append(grads[0] if grads[0] is not None else torch.zeros_like(last))
                st.grads.accumulate(self.names, grads[1:])
                st.loss_sum = st.loss_sum + loss.detach()
            st.hidden[m] = None
            st.grad_h.append(torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0])
        # its gradient is whole (a tied head's part is the prologue's)
        st.grads.finish_resident(self.graph.epilogue.id)

    def _forward(self, st: PassState, mb: MicroBatch, last: torch.Tensor):
        """The model's own forward with every block proxied, the last one returning `last`."""
        g = self.graph

        def tail(index: int, call: BlockCall):
            return wrap_block_output(last if index == self.n_blocks - 1 else call.hidden, g.block_output)

        with proxied_blocks(self.model, g.blocks_path, tail):
            return torch.func.functional_call(self.model, st.top, (mb.input_ids,), model_kwargs(g.forward_kwargs, mb))

    def _fused(self, st: PassState, m: int, mb: MicroBatch) -> torch.Tensor | None:
        """The fused-loss epilogue of one micro-batch; None (and `fused_head` set False for good)
        when the model's logits are not the head's plain output."""
        last = st.hidden[m].detach().requires_grad_(True)
        with torch.enable_grad(), self.head.active() as cap:
            out = self._forward(st, mb, last)
        head_name = next((n for n in self.names if st.leaves[n] is cap.weight), None)
        if not cap.returned_as_logits(out) or head_name is None:
            self.fused_head = False
            return None
        self.fused_head = True
        x = cap.input
        result = linear_cross_entropy(
            x.detach().reshape(-1, x.shape[-1]), cap.weight.detach(), next_token_labels(mb.labels),
            scale=1.0 / st.global_tokens, chunk_tokens=self.loss_chunk_tokens,
            grad_weight_acc=st.grads.acc_view(head_name, cap.weight.shape))
        others = [n for n in self.names if n != head_name]
        grads = torch.autograd.grad(x, [last] + [st.leaves[n] for n in others],
                                    result.grad_hidden.view_as(x), allow_unused=True)
        st.grads.accumulate(others, grads[1:])
        st.loss_sum = st.loss_sum + result.loss
        return grads[0] if grads[0] is not None else torch.zeros_like(last)


    def _streamed(self, st: PassState) -> None:
        """The head streams by vocabulary chunk (vocab_stream.py): every micro-batch's final hidden state
        first (the model's forward with the head captured), then the chunked loss over all of them (each
        chunk loaded once for the forward and once for the backward), then the backward of the rest of
        the epilogue (final norm) per micro-batch."""
        table = self.weights.vocab[self.graph.epilogue.id]
        head = st.leaves[table.name]
        lasts, xs, labels = [], [], []
        for m, mb in enumerate(st.micro_batches):
            last = st.hidden[m].detach().requires_grad_(True)
            if self.head is None:
                raise RuntimeError("a streamed head needs a bias-free nn.Linear output head (get_output_embeddings)")
            with torch.enable_grad(), self.head.active() as cap:
                out = self._forward(st, mb, last)
            if not cap.returned_as_logits(out) or cap.weight is not head:
                raise RuntimeError(f"the model's logits are not {table.name}'s plain output (scaled, capped or "
                                   "another weight): its head cannot stream by vocabulary chunk (plan it resident: "
                                   "SolverOptions(vocab_streamed=()))")
            self.fused_head = True
            lasts.append(last)
            xs.append(cap.input)
            labels.append(next_token_labels(mb.labels))
        lid = self.graph.epilogue.id
        send = lambda r0, r1, grad: st.grads.send_vocab_chunk(self.weights.routes, self.weights.streams, lid, r0, r1,
                                                             grad)
        loss, grads = self.weights.vocab_stream.head_loss(
            table, [x.detach().reshape(-1, x.shape[-1]) for x in xs], labels, scale=1.0 / st.global_tokens,
            chunk_tokens=self.loss_chunk_tokens, send=send)
        st.loss_sum = st.loss_sum + loss
        others = [n for n in self.names if n != table.name]
        for m, (last, x) in enumerate(zip(lasts, xs)):
            g = torch.autograd.grad(x, [last] + [st.leaves[n] for n in others], grads[m].to(x.dtype).view_as(x),
                                    allow_unused=True)
            st.grads.accumulate(others, g[1:])
            st.hidden[m] = None
            st.grad_h.append(g[0] if g[0] is not None else torch.zeros_like(last))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy (fp32) over positions whose shifted label is not -100."""
    vocab = logits.shape[-1]
    shifted_logits = logits[:, :-1, :].reshape(-1, vocab).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=-100, reduction="sum")
