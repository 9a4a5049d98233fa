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

The backward is made one row range of the table at a time (`costmodel.memory.embedding_grad_chunk_rows`),
not as one dense [vocab, hidden] fp32 tensor (2.3 GiB for the Qwen3-8B table): each range's lookups keep
their row within it, the others (and the padding row's) go to a spare row past its end that is
excluded as the padding index, so no range needs the device to say which lookups hit it. Each row sums
the same lookups as over the whole table (on the CPU, to the bit: tests/backend/test_embedding_grads.py).
What it holds at once is `costmodel.memory.embedding_grad_bytes`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from slidedp.costmodel.memory import embedding_grad_chunk_rows


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
            grad = torch.empty(ids.numel(), acc.shape[-1], dtype=torch.float32, device=acc.device)
            at = 0
            for _, g in done:  # cast into one fp32 buffer, without a concatenation in the compute dtype
                n = g.numel() // g.shape[-1]
                grad[at:at + n].copy_(g.reshape(n, -1))
                at += n
            add_embedding_backward_(acc, grad, ids, self.padding[key])
            del ids, grad
        self.records = {k: r for k, r in self.records.items() if self.weights[k][1] is None}


def add_embedding_backward_(acc: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, padding: int) -> None:
    """acc [rows, hidden] += the embedding backward of output gradients `grad` [n, hidden] (fp32) at `ids`
    [n], the `padding` row (-1: none) left out, one row range at a time (see the module docstring)."""
    rows, hidden = acc.shape
    step = embedding_grad_chunk_rows(rows, hidden)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        spare = r1 - r0  # the range's own rows are 0 .. spare - 1
        local = (ids - r0).masked_fill_((ids < r0) | (ids >= r1) | (ids == padding), spare)
        part = torch.ops.aten.embedding_dense_backward(grad, local, spare + 1, spare, False)
        acc[r0:r1].add_(part[:spare])
        del part, local


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
