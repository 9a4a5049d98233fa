"""The streamed step: runs a lowered Program (see program.py) with the model's own modules.

Order within one pass over the weights (layer-major, so each block is loaded once per pass for
forward and at most once more for backward, whatever the number of micro-batches):

  1. prologue, per micro-batch: the model's own forward with proxied blocks, stopped at the last
     block; records each block's arguments (masks, rotary tables, ...) and the first hidden state.
  2. blocks 0..N-1: load weights into a slot (H2D stream), run every micro-batch without autograd,
     keep each block's input (the boundary activation) for recomputation.
  3. epilogue, per micro-batch: the model's own forward again, the last block returning the final
     hidden state as a leaf; token-weighted cross-entropy; gradients of the head and that leaf.
  4. blocks N-1..0: recompute each micro-batch with autograd, backpropagate, accumulate parameter
     gradients in one flat fp32 buffer, take its sum of squares, copy it to the host (D2H stream).
  5. prologue backward (its embedding tables' gradients in one fp32 embedding backward over every
     micro-batch: embedding_grads.py); its gradient goes to the host last (the epilogue's went
     after step 3).

Numerics are the model's own: blocks run through `torch.func.functional_call` with device views
of the streamed weights. Prologue and epilogue weights stay resident for the whole step.

With `compile_blocks`, every block's forward (without autograd when it is recomputed later, with
it in a kept or offloaded block's forward and in a recomputation) runs through `torch.compile` of
that same functional call: one compiled graph per grad mode and input shape serves every block of
the model (the weights are graph inputs, so the blocks do not recompile), fusing the elementwise
work between the matmuls and cutting the Python issued per block. The saved-tensor hooks of kept
and offloaded blocks (saved_activations.py) act on what the compiled graph saves for its backward
as they do on eager autograd's saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from slidedp.backend.runtime.embedding_grads import EmbeddingGrads
from slidedp.backend.state.host_state import HostState
from slidedp.backend.runtime.saved_activations import HostArena, SavedActivations
from slidedp.backend.runtime.routes import Routes
from slidedp.backend.runtime.streams import Streams
from slidedp.backend.lowering.program import (
    ALLOC, BWD, D2H_GRAD, EPILOGUE, FREE, FWD, H2D_WEIGHTS, PROLOGUE, PROLOGUE_BWD, Program,
)
from slidedp.backend.kernels.grad_pack import pack_grads
from slidedp.backend.kernels.linear_cross_entropy import linear_cross_entropy, next_token_labels
from slidedp.ir.blocks import (
    BlockCall,
    HeadCapture,
    StopForward,
    find_blocks,
    logits_of,
    proxied_blocks,
    unwrap_block_output,
    wrap_block_output,
)
from slidedp.ir.graph import BLOCK, LayerGraph


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] on the device
    labels: torch.Tensor  # [b, s] on the device, unshifted, -100 ignored
    attention_mask: torch.Tensor | None


class StreamedExecutor:
    """Owns the device-side buffers of one rank and runs passes over the weights."""

    def __init__(self, model: nn.Module, graph: LayerGraph, host: HostState, program: Program, *,
                 device: torch.device, compute_dtype: torch.dtype, routes_for: Callable[[Streams], Routes],
                 loss_chunk_tokens: int | None = None, compile_blocks: bool = False):
        self.model = model
        self.graph = graph
        self.host = host
        self.program = program
        self.device = device
        self.dtype = compute_dtype
        self.streams = Streams(device)
        self.routes = routes_for(self.streams)  # weights up, gradients down (routes.py)
        _, self.blocks = find_blocks(model)
        self.block_layers = [layer for layer in graph.layers if layer.kind == BLOCK]
        self.n_blocks = len(self.block_layers)
        self.resident_ids = (graph.prologue.id, graph.epilogue.id)
        self.window = program.n_slots
        self.activation = [op.policy for op in program.ops if op.kind == FWD]
        self.loss_chunk_tokens = loss_chunk_tokens
        self.compile_blocks = compile_blocks
        self.call_block = torch.compile(run_block, dynamic=False) if compile_blocks else run_block
        self.head = HeadCapture.find(model)  # a plain linear head: the loss is fused (see _op_epilogue)
        self.fused_head: bool | None = None  # known after the first epilogue
        self.epilogue_names = [p.name for p in graph.epilogue.params] + list(graph.epilogue.tied_param_names)
        self.min_offload_bytes = 1 << 16  # smaller saved tensors stay on the device
        self.resident_stale: set[int] = set(self.resident_ids)  # resident weights to (re)load
        self.offloaded_bytes = 0  # activation bytes offloaded to the host in the last pass
        self.arena: HostArena | None = None  # host memory of offloaded activations, made on first use
        # Where each stored parameter lives: name -> (layer id, start, numel).
        self.locate = {
            name: (layout.layer_id, start, numel)
            for layout in host.layouts
            for name, start, numel, _ in layout.param_offsets
        }
        # Resident layers: device weights (compute dtype) loaded at the start of each step.
        self.resident = {
            lid: torch.empty(host.layouts[lid].numel, dtype=compute_dtype, device=device)
            for lid in self.resident_ids
        }
        max_block = max(layer.numel for layer in self.block_layers)
        self.slots = [torch.empty(max_block, dtype=compute_dtype, device=device) for _ in range(self.window)]
        # Constants: buffers and frozen parameters, on the device once.
        prefix = graph.blocks_path + "."
        self.top_constants = {
            name: self._constant(t) for name, t in _constants(model) if not name.startswith(prefix)
        }
        self.block_constants = [
            {name: self._constant(t) for name, t in _constants(block)} for block in self.blocks
        ]

    def _constant(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):  # frozen parameter: compute dtype like the others
            return t.detach().to(self.device, self.dtype if t.is_floating_point() else t.dtype)
        return t.detach().to(self.device)

    # -- weights ------------------------------------------------------------------------------
    def ensure_resident(self, layer_id: int) -> None:
        """H2D of a prologue/epilogue layer's weights if an update changed them since the last load."""
        if layer_id not in self.resident_stale:
            return
        self.routes.load(layer_id, self.resident[layer_id], self.host.layers[layer_id].source)
        self.streams.wait("compute", self.streams.record("h2d"))
        self.resident_stale.discard(layer_id)

    def _block_params(self, block: int, slot: int, requires_grad: bool) -> dict[str, torch.Tensor]:
        layer = self.block_layers[block]
        flat = self.slots[slot]
        prefix = layer.name + "."
        out = {}
        for name, start, numel, shape in self.host.layouts[layer.id].param_offsets:
            view = flat[start : start + numel].view(shape)
            if requires_grad:
                view = view.detach().requires_grad_(True)
            out[name[len(prefix):]] = view
        out.update(self.block_constants[block])
        return out

    # -- the pass: interpret the program --------------------------------------------------------
    def run_pass(self, micro_batches: list[MicroBatch], global_tokens: int) -> torch.Tensor:
        """One pass over the weights; each layer's gradient goes to the host by `self.routes`.
        Returns the pass's loss: sum over its micro-batches of (token CE sum / global_tokens)."""
        st = _PassState(self, micro_batches, global_tokens)
        self.offloaded_bytes = 0
        self._arena_for(len(micro_batches)).reset()
        events: dict[int, object] = {}
        handlers = {
            PROLOGUE: self._op_prologue, H2D_WEIGHTS: self._op_h2d_weights, FWD: self._op_fwd,
            EPILOGUE: self._op_epilogue, BWD: self._op_bwd, PROLOGUE_BWD: self._op_prologue_bwd,
            D2H_GRAD: self._op_d2h_grad, ALLOC: None, FREE: None,  # the caching allocator does these
        }
        for op in self.program.ops:
            for e in op.waits:
                self.streams.wait(op.stream, events[e])
            handler = handlers[op.kind]
            if handler is not None:
                with self.streams.range(op.text().split(None, 1)[1]):
                    handler(op, st)
            if op.record is not None:
                events[op.record] = self.streams.record(op.stream)
        return st.loss_sum

    def _op_prologue(self, op, st: "_PassState") -> None:
        """The model's forward up to the last block, per micro-batch: records every block's inputs."""
        g = self.graph
        self.ensure_resident(g.prologue.id)
        with st.embedding_grads:
            self._prologue_forward(st)
        st.h0 = [c[0].hidden for c in st.calls]
        st.hidden = [h.detach() for h in st.h0]

    def _prologue_forward(self, st: "_PassState") -> None:
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
                    torch.func.functional_call(self.model, st.top, (mb.input_ids,), _kwargs(g.forward_kwargs, mb))
                except StopForward:
                    pass
            st.calls.append(recorded)

    def _op_h2d_weights(self, op, st: "_PassState") -> None:
        layer = self.block_layers[op.block]
        self.routes.load(layer.id, self.slots[op.slot], self.host.layers[layer.id].source)

    def _op_fwd(self, op, st: "_PassState") -> None:
        """Forward of one block for every micro-batch, under the plan's activation policy."""
        k, policy = op.block, op.policy
        module = self.blocks[k]
        params = self._block_params(k, op.slot, requires_grad=policy != "recompute")
        for m, call in enumerate(st.calls):
            if policy == "recompute":  # keep only the input; recompute in backward
                st.stash[k][m] = st.hidden[m]
                args, kwargs = call[k].with_hidden(st.hidden[m])
                with torch.no_grad():
                    out = self.call_block(module, params, args, kwargs)
                st.hidden[m] = unwrap_block_output(out)[0]
                continue
            x = st.hidden[m].detach().requires_grad_(True)
            saved = SavedActivations(self.slots[op.slot], self.streams, offload=policy == "offload",
                                     min_offload_bytes=self.min_offload_bytes, arena=self.arena)
            args, kwargs = call[k].with_hidden(x)
            with torch.enable_grad(), saved.hooks():
                out = unwrap_block_output(self.call_block(module, params, args, kwargs))[0]
            st.kept[k][m] = KeptForward(x, out, params, saved)
            self.offloaded_bytes += saved.offloaded_bytes
            st.hidden[m] = out.detach()

    def _arena_for(self, micro_batches: int) -> HostArena:
        """The host arena of offloaded activations: what the offloading blocks save per micro-batch
        (the IR's figure) times the micro-batches, allocated (and registered) once."""
        need = micro_batches * sum(layer.costs.saved_activation_bytes
                                   for layer, policy in zip(self.block_layers, self.activation) if policy == "offload")
        if self.arena is None or self.arena.buffer.numel() < need:
            if self.arena is not None:
                self.arena.close()
            self.arena = HostArena(need, pin=self.streams.cuda)
        return self.arena

    def close(self) -> None:
        """Release the host arena (unregistered first)."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def _op_epilogue(self, op, st: "_PassState") -> None:
        """Head and token-weighted loss per micro-batch; gradient of the last hidden state.

        With a plain linear head (see HeadCapture) the loss is a fused linear + cross-entropy over
        `loss_chunk_tokens` tokens at a time that never holds the full logits, and the head's
        weight gradient goes straight into its fp32 accumulator; otherwise the model's logits are
        computed and the loss taken in row chunks.
        """
        self.ensure_resident(self.graph.epilogue.id)
        for m, mb in enumerate(st.micro_batches):
            if self.head is not None and self.fused_head is not False:
                grad = self._epilogue_fused(st, m, mb)
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
                    logits = logits_of(self._epilogue_forward(st, part, last))
                    loss = token_loss_sum(logits, part.labels) / st.global_tokens
                    del logits
                grads = torch.autograd.grad(loss, [last] + [st.leaves[n] for n in self.epilogue_names],
                                            allow_unused=True)
                grad_parts.append(grads[0] if grads[0] is not None else torch.zeros_like(last))
                self._accumulate(st.resident_acc, self.epilogue_names, grads[1:])
                st.loss_sum = st.loss_sum + loss.detach()
            st.hidden[m] = None
            st.grad_h.append(torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0])
        epi = self.graph.epilogue.id  # its gradient is whole (a tied head's part is the prologue's)
        st.finish_gradient(epi, st.resident_acc[epi])

    def _epilogue_forward(self, st: "_PassState", mb: MicroBatch, last: torch.Tensor):
        """The model's own forward with every block proxied, the last one returning `last`."""
        g = self.graph

        def tail(index: int, call: BlockCall):
            return wrap_block_output(last if index == self.n_blocks - 1 else call.hidden, g.block_output)

        with proxied_blocks(self.model, g.blocks_path, tail):
            return torch.func.functional_call(self.model, st.top, (mb.input_ids,), _kwargs(g.forward_kwargs, mb))

    def _epilogue_fused(self, st: "_PassState", m: int, mb: MicroBatch) -> torch.Tensor | None:
        """The fused-loss epilogue of one micro-batch; None (and `fused_head` set False for good)
        when the model's logits are not the head's plain output."""
        last = st.hidden[m].detach().requires_grad_(True)
        with torch.enable_grad(), self.head.active() as cap:
            out = self._epilogue_forward(st, mb, last)
        head_name = next((n for n in self.epilogue_names if st.leaves[n] is cap.weight), None)
        if not cap.returned_as_logits(out) or head_name is None:
            self.fused_head = False
            return None
        self.fused_head = True
        lid, start, numel = self.locate[head_name]
        x = cap.input
        result = linear_cross_entropy(
            x.detach().reshape(-1, x.shape[-1]), cap.weight.detach(), next_token_labels(mb.labels),
            scale=1.0 / st.global_tokens, chunk_tokens=self.loss_chunk_tokens,
            grad_weight_acc=st.resident_acc[lid][start : start + numel].view(cap.weight.shape))
        others = [n for n in self.epilogue_names if n != head_name]
        grads = torch.autograd.grad(x, [last] + [st.leaves[n] for n in others],
                                    result.grad_hidden.view_as(x), allow_unused=True)
        self._accumulate(st.resident_acc, others, grads[1:])
        st.loss_sum = st.loss_sum + result.loss
        return grads[0] if grads[0] is not None else torch.zeros_like(last)

    def _op_bwd(self, op, st: "_PassState") -> None:
        """Backward of one block for every micro-batch; its gradient summed in one fp32 buffer by
        the packing kernel, which also gives the gradient's sum of squares (for exact clipping)."""
        k = op.block
        layer = self.block_layers[k]
        module = self.blocks[k]
        acc = torch.empty(layer.numel, dtype=torch.float32, device=self.device)
        spans = [(start, numel) for _, start, numel, _ in self.host.layouts[layer.id].param_offsets]
        if op.policy == "recompute":
            params = self._block_params(k, op.slot, requires_grad=True)
        last = len(st.calls) - 1
        for m, call in enumerate(st.calls):
            if op.policy == "recompute":
                x = st.stash[k][m].detach().requires_grad_(True)
                st.stash[k][m] = None
                args, kwargs = call[k].with_hidden(x)
                with torch.enable_grad():
                    out = unwrap_block_output(self.call_block(module, params, args, kwargs))[0]
                leaves = params
            else:  # the forward's graph, its weights read from the slot that holds them now
                fwd, st.kept[k][m] = st.kept[k][m], None
                fwd.saved.slot = self.slots[op.slot]
                x, out, leaves = fwd.x, fwd.out, fwd.params
            trainable = list(leaves.values())[: len(spans)]
            grads = torch.autograd.grad(out, [x] + trainable, st.grad_h[m], allow_unused=True)
            st.grad_h[m] = grads[0]
            stats = pack_grads(grads[1:], spans, acc, [(0, layer.numel)] if m == last else (), accumulate=m > 0)
            del grads
        st.sumsq[layer.id] = stats.sumsq[0]
        st.grad_src[layer.id] = acc

    def _op_prologue_bwd(self, op, st: "_PassState") -> None:
        names = [p.name for p in self.graph.prologue.params]
        if names:
            for m, h in enumerate(st.h0):
                if h.requires_grad:
                    grads = torch.autograd.grad(h, [st.leaves[n] for n in names], st.grad_h[m], allow_unused=True)
                    self._accumulate(st.resident_acc, names, grads)
            st.embedding_grads.accumulate()
        st.finish_gradient(self.graph.prologue.id, st.resident_acc[self.graph.prologue.id])

    def _op_d2h_grad(self, op, st: "_PassState") -> None:
        """The layer's fp32 gradient to the host by its reduction route, chunk by chunk; cast on the
        D2H stream one chunk at a time when the host gradient is bf16 (costmodel.memory.grad_staging_bytes)."""
        self.routes.gradient(op.layer_id, st.grad_src.pop(op.layer_id), st.sumsq[op.layer_id])

    def _accumulate(self, resident_acc, names, grads) -> None:
        for name, gp in zip(names, grads):
            if gp is not None:
                lid, start, numel = self.locate[name]
                resident_acc[lid][start : start + numel].add_(gp.reshape(-1).float())


class _PassState:
    """What one pass carries between its ops: block inputs, activations, gradients, the loss."""

    def __init__(self, ex: StreamedExecutor, micro_batches, global_tokens):
        n, m = ex.n_blocks, len(micro_batches)
        self.micro_batches, self.global_tokens = micro_batches, global_tokens
        self.device = ex.device
        self.leaves = {
            name: ex.resident[lid][start : start + numel].view(ex.model.get_parameter(name).shape)
            .detach().requires_grad_(True)
            for name, (lid, start, numel) in ex.locate.items() if lid in ex.resident_ids
        }
        self.top = {**self.leaves, **ex.top_constants}
        self.resident_acc = {lid: torch.zeros(ex.resident[lid].numel(), dtype=torch.float32, device=ex.device)
                             for lid in ex.resident_ids}

        def acc_view(name: str) -> torch.Tensor:
            lid, start, numel = ex.locate[name]
            return self.resident_acc[lid][start : start + numel].view(self.leaves[name].shape)

        self.embedding_grads = EmbeddingGrads(  # the prologue's weights, any of them an embedding table
            {id(self.leaves[p.name]): (self.leaves[p.name], acc_view(p.name)) for p in ex.graph.prologue.params})
        self.calls: list[list[BlockCall]] = []
        self.h0: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor | None] = []
        self.stash: list[list[torch.Tensor | None]] = [[None] * m for _ in range(n)]
        self.kept: list[list[KeptForward | None]] = [[None] * m for _ in range(n)]
        self.grad_h: list[torch.Tensor] = []
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=ex.device)
        n_layers = len(ex.graph.layers)
        self.sumsq: list[torch.Tensor | None] = [None] * n_layers  # of this pass's gradient, on the device
        self.grad_src: dict[int, torch.Tensor] = {}

    def finish_gradient(self, layer_id: int, acc: torch.Tensor) -> None:
        """Sum of squares of a layer's fp32 gradient; the gradient waits for its D2H op."""
        self.sumsq[layer_id] = torch.dot(acc, acc) if acc.numel() else torch.zeros((), device=self.device)
        self.grad_src[layer_id] = acc


@dataclass
class KeptForward:
    """A kept block's forward for one micro-batch: its input leaf, output and graph's weights."""

    x: torch.Tensor
    out: torch.Tensor
    params: dict[str, torch.Tensor]
    saved: SavedActivations


def run_block(module: nn.Module, params: dict, args: tuple, kwargs: dict):
    """One block's forward with the given weights (what `compile_blocks` compiles)."""
    return torch.func.functional_call(module, params, args, kwargs)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy (fp32) over positions whose shifted label is not -100."""
    vocab = logits.shape[-1]
    shifted_logits = logits[:, :-1, :].reshape(-1, vocab).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=-100, reduction="sum")


def _kwargs(allowed: tuple[str, ...], mb: MicroBatch) -> dict:
    out = {"use_cache": False} if "use_cache" in allowed else {}
    if mb.attention_mask is not None:
        out["attention_mask"] = mb.attention_mask
    return out


def _constants(module: nn.Module):
    """Buffers and frozen parameters: what a functional call needs besides trainable weights."""
    for name, b in module.named_buffers():
        yield name, b
    for name, p in module.named_parameters():
        if not p.requires_grad:
            yield name, p
