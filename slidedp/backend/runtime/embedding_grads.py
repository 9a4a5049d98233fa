"""Weight gradients of the prologue's embedding tables, one fp32 embedding backward per pass.

Left to autograd, each micro-batch's backward through an embedding writes a dense gradient of the
whole table in the compute dtype (151,936 x 2,560 for Qwen3-4B), which the executor then casts and
adds into the layer's fp32 accumulator: three passes over the table per micro-batch, for the few
thousand rows the micro-batch touched. Instead, while the prologue's forward runs under
`EmbeddingGrads`, an embedding of one of its weights is computed on the detached weight and its
output's gradient is recorded (with the indices) when the backward reaches it; `accumulate` then
runs PyTorch's own embedding backward once over every recorded micro-batch, in fp32, and adds the
result into the accumulator. Same function (padding row excluded, as `F.embedding` defines it), one
rounding instead of one per micro-batch. Embeddings with `max_norm`, `scale_grad_by_freq` or
`sparse` are left to autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class EmbeddingGrads(TorchFunctionMode):
    """Active around the prologue's forward; `weights` maps id() of each tracked weight (the tensor the
    model is called with, held here too so that its id cannot be reused) to (weight, its gradient's
    fp32 accumulator viewed in the weight's shape)."""

    def __init__(self, weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]]):
        super().__init__()
        self.weights = weights
        # id() of a streamed table's stand-in -> fn(ids) giving the embedding's output (vocab_stream.py);
        # its records are read by the streamed backward, not by `accumulate` (its accumulator is None)
        self.lookup: dict[int, object] = {}
        self.used: set[int] = set()  # the lookups the forward went through
        self.records: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.padding: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and self.lookup:
            call = _embedding_args(*args, **kwargs)
            key = id(call["weight"])
            if key in self.lookup and not torch.is_grad_enabled():
                self.used.add(key)
                return self.lookup[key](call["input"])
        if func is F.embedding and torch.is_grad_enabled():
            call = _embedding_args(*args, **kwargs)
            key = id(call["weight"])
            if key in self.lookup:
                if call["max_norm"] is not None or call["scale_grad_by_freq"] or call["sparse"]:
                    raise RuntimeError("a streamed embedding table cannot take max_norm, scale_grad_by_freq or sparse")
                self.used.add(key)
            if key in self.weights and call["max_norm"] is None and not call["scale_grad_by_freq"] \
                    and not call["sparse"]:
                weight, ids = call["weight"], call["input"]
                out = self.lookup[key](ids) if key in self.lookup else func(ids, weight.detach(), call["padding_idx"])
                padding = call["padding_idx"]
                self.padding[key] = -1 if padding is None else padding % weight.shape[0]
                record = [ids, None]
                self.records.setdefault(key, []).append(record)
                return _RecordGradient.apply(weight, out, record)
        return func(*args, **kwargs)

    def accumulate(self) -> None:
        """The recorded micro-batches' weight gradients into the accumulators (then forgets them)."""
        for key, records in self.records.items():
            done = [(ids, g) for ids, g in records if g is not None]
            weight, acc = self.weights[key]
            if not done or acc is None:
                continue
            ids = torch.cat([i.reshape(-1) for i, _ in done])
            grad = torch.cat([g.reshape(-1, g.shape[-1]) for _, g in done]).float()
            acc.add_(torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], self.padding[key], False))
        self.records = {k: r for k, r in self.records.items() if self.weights[k][1] is None}


def _embedding_args(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                    sparse=False):
    return dict(input=input, weight=weight, padding_idx=padding_idx, max_norm=max_norm,
                scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)


class _RecordGradient(torch.autograd.Function):
    """Identity on the embedding's output; its backward records the output's gradient. The weight is
    an input only so that a backward asked for the weight's gradient runs through here."""

    @staticmethod
    def forward(ctx, weight, out, record):
        ctx.record = record
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.record[1] = grad if ctx.record[1] is None else ctx.record[1] + grad
        return None, None, None
