"""The streamed step: forward and backward layer by layer, gradients drained to the host state.

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
  5. prologue backward; the resident layers' gradients go to the host last.

Numerics are the model's own: blocks run through `torch.func.functional_call` with device views
of the streamed weights. Prologue and epilogue weights stay resident for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slidedp.backend.host_state import HostState
from slidedp.backend.saved_activations import SavedActivations
from slidedp.backend.streams import Guard, Streams
from slidedp.backend.weight_window import schedule_window
from slidedp.ir.blocks import (
    BlockCall,
    StopForward,
    find_blocks,
    logits_of,
    proxied_blocks,
    unwrap_block_output,
    wrap_block_output,
)
from slidedp.ir.build import model_forward
from slidedp.ir.graph import BLOCK, LayerGraph


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] on the device
    labels: torch.Tensor  # [b, s] on the device, unshifted, -100 ignored
    attention_mask: torch.Tensor | None


@dataclass
class PassResult:
    loss_sum: torch.Tensor  # sum over micro-batches of (token CE sum / global tokens), device scalar
    sumsq: list[torch.Tensor]  # per layer: sum of squares of this pass's gradient (device fp32)
    d2h: list[Guard]  # per layer: the host gradient (or staging) and the event of its copy


class StreamedExecutor:
    """Owns the device-side buffers of one rank and runs passes over the weights."""

    def __init__(self, model: nn.Module, graph: LayerGraph, host: HostState, *, device: torch.device,
                 compute_dtype: torch.dtype, window: int, activation: dict[int, str] | None = None,
                 chunks: dict[int, int] | None = None, loss_chunk_rows: int | None = None):
        self.model = model
        self.graph = graph
        self.host = host
        self.device = device
        self.dtype = compute_dtype
        self.streams = Streams(device)
        _, self.blocks = find_blocks(model)
        self.block_layers = [layer for layer in graph.layers if layer.kind == BLOCK]
        self.n_blocks = len(self.block_layers)
        self.resident_ids = (graph.prologue.id, graph.epilogue.id)
        self.window = window
        activation = activation or {}
        self.activation = [activation.get(layer.id, "recompute") for layer in self.block_layers]
        unknown = set(self.activation) - {"recompute", "keep", "offload"}
        if unknown:
            raise ValueError(f"unknown activation policy {sorted(unknown)}: recompute, keep or offload")
        self.chunks = {layer.id: max(1, (chunks or {}).get(layer.id, 1)) for layer in graph.layers}
        self.loss_chunk_rows = loss_chunk_rows
        self.min_offload_bytes = 1 << 16  # smaller saved tensors stay on the device
        self.offloaded_bytes = 0  # activation bytes offloaded to the host in the last pass
        self.schedule = schedule_window(
            list(range(self.n_blocks)) + list(range(self.n_blocks - 1, -1, -1)), window
        )
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
        self.slots = [torch.empty(max_block, dtype=compute_dtype, device=device) for _ in range(window)]
        self.slot_free: list = [None] * window  # event: compute's last read of the slot
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
    def load_resident(self) -> None:
        """H2D of the prologue/epilogue weights from the host delivery copy (after an update)."""
        for lid, flat in self.resident.items():
            guard = self.streams.copy("h2d", flat, self.host.layers[lid].source)
            self.streams.wait("compute", guard.event)

    def _issue_load(self, load) -> None:
        """H2D of a block's weights into its slot, in the plan's number of chunks."""
        layer = self.block_layers[load.block]
        src = self.host.layers[layer.id].source
        dst = self.slots[load.slot][: layer.numel]
        self.streams.wait("h2d", self.slot_free[load.slot])
        for lo, hi in chunk_bounds(layer.numel, self.chunks[layer.id]):
            guard = self.streams.copy("h2d", dst[lo:hi], src[lo:hi])
        self._slot_ready[load.slot] = guard.event

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

    # -- the pass ------------------------------------------------------------------------------
    def run_pass(self, micro_batches: list[MicroBatch], global_tokens: int,
                 grad_targets: list[torch.Tensor]) -> PassResult:
        """One pass over the weights; layer i's gradient is copied into `grad_targets[i]` (host)."""
        g = self.graph
        self._targets = grad_targets
        self.offloaded_bytes = 0
        kw = g.forward_kwargs
        leaves = {
            name: self.resident[lid][start : start + numel].view(self.model.get_parameter(name).shape)
            .detach().requires_grad_(True)
            for name, (lid, start, numel) in self.locate.items() if lid in self.resident_ids
        }
        top = {**leaves, **self.top_constants}
        resident_acc = {lid: torch.zeros(self.resident[lid].numel(), dtype=torch.float32, device=self.device)
                        for lid in self.resident_ids}

        # 1. prologue
        calls: list[list[BlockCall]] = []
        for mb in micro_batches:
            recorded: list[BlockCall] = []

            def capture(index: int, call: BlockCall, recorded=recorded):
                recorded.append(call)
                if index == self.n_blocks - 1:
                    raise StopForward
                return wrap_block_output(call.hidden, g.block_output)

            with self.streams.range("prologue"), proxied_blocks(self.model, g.blocks_path, capture):
                try:
                    torch.func.functional_call(self.model, top, (mb.input_ids,), _kwargs(kw, mb))
                except StopForward:
                    pass
            calls.append(recorded)
        h0 = [c[0].hidden for c in calls]
        hidden = [h.detach() for h in h0]

        # 2. blocks forward, 4. blocks backward: one walk over the window schedule.
        sched = self.schedule
        self._slot_ready = [None] * self.window
        pending = list(sched.loads)
        self._issue_ready_loads(pending, issued_position=-1)
        stash: list[list[torch.Tensor | None]] = [[None] * len(micro_batches) for _ in range(self.n_blocks)]
        kept: list[list[KeptForward | None]] = [[None] * len(micro_batches) for _ in range(self.n_blocks)]
        sumsq: list[torch.Tensor | None] = [None] * len(g.layers)
        d2h: list[Guard | None] = [None] * len(g.layers)
        grad_h: list[torch.Tensor] = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for position, block in enumerate(sched.sequence):
            slot = sched.slot_of[position]
            self.streams.wait("compute", self._slot_ready[slot])
            module = self.blocks[block]
            name = self.block_layers[block].name
            if position < self.n_blocks:  # forward
                policy = self.activation[block]
                params = self._block_params(block, slot, requires_grad=policy != "recompute")
                with self.streams.range(f"fwd {name}"):
                    for m, call in enumerate(calls):
                        if policy == "recompute":  # keep only the input; recompute in backward
                            stash[block][m] = hidden[m]
                            args, kwargs = call[block].with_hidden(hidden[m])
                            with torch.no_grad():
                                out = torch.func.functional_call(module, params, args, kwargs)
                            hidden[m] = unwrap_block_output(out)[0]
                            continue
                        x = hidden[m].detach().requires_grad_(True)
                        saved = SavedActivations(self.slots[slot], self.streams, offload=policy == "offload",
                                                 min_offload_bytes=self.min_offload_bytes)
                        args, kwargs = call[block].with_hidden(x)
                        with torch.enable_grad(), saved.hooks():
                            out = unwrap_block_output(torch.func.functional_call(module, params, args, kwargs))[0]
                        kept[block][m] = KeptForward(x, out, params, saved)
                        self.offloaded_bytes += saved.offloaded_bytes
                        hidden[m] = out.detach()
                if position == self.n_blocks - 1:
                    # 3. epilogue, while the last blocks' weights stay in their slots
                    grad_h, loss_sum = self._epilogue(micro_batches, calls, hidden, top, leaves,
                                                      resident_acc, global_tokens)
            else:  # backward
                layer = self.block_layers[block]
                acc = torch.zeros(layer.numel, dtype=torch.float32, device=self.device)
                offsets = [(start, numel) for _, start, numel, _ in self.host.layouts[layer.id].param_offsets]
                if self.activation[block] == "recompute":
                    params = self._block_params(block, slot, requires_grad=True)
                with self.streams.range(f"bwd {name}"):
                    for m, call in enumerate(calls):
                        if self.activation[block] == "recompute":
                            x = stash[block][m].detach().requires_grad_(True)
                            stash[block][m] = None
                            args, kwargs = call[block].with_hidden(x)
                            with torch.enable_grad():
                                out = unwrap_block_output(torch.func.functional_call(module, params, args, kwargs))[0]
                            block_leaves = params
                        else:  # the forward's graph, its weights read from this slot
                            fwd = kept[block][m]
                            kept[block][m] = None
                            fwd.saved.slot = self.slots[slot]
                            x, out, block_leaves = fwd.x, fwd.out, fwd.params
                        trainable = list(block_leaves.values())[: len(offsets)]
                        grads = torch.autograd.grad(out, [x] + trainable, grad_h[m], allow_unused=True)
                        grad_h[m] = grads[0]
                        for (start, numel), gp in zip(offsets, grads[1:]):
                            if gp is not None:
                                acc[start : start + numel].add_(gp.reshape(-1))
                sumsq[layer.id], d2h[layer.id] = self._drain(layer.id, acc)
            self.slot_free[slot] = self.streams.record("compute")
            self._issue_ready_loads(pending, issued_position=position)

        # 5. prologue backward, then the resident layers' gradients.
        pro = self.graph.prologue
        pro_names = [p.name for p in pro.params]
        if pro_names:
            with self.streams.range("prologue backward"):
                for m, h in enumerate(h0):
                    if h.requires_grad:
                        grads = torch.autograd.grad(h, [leaves[n] for n in pro_names], grad_h[m],
                                                    allow_unused=True)
                        self._accumulate(resident_acc, pro_names, grads)
        for lid in self.resident_ids:
            sumsq[lid], d2h[lid] = self._drain(lid, resident_acc[lid])
        return PassResult(loss_sum=loss_sum, sumsq=sumsq, d2h=d2h)

    def _issue_ready_loads(self, pending: list, issued_position: int) -> None:
        while pending and pending[0].issue_after <= issued_position:
            self._issue_load(pending.pop(0))

    def _epilogue(self, micro_batches, calls, hidden, top, leaves, resident_acc, global_tokens):
        g = self.graph
        epi_names = [p.name for p in g.epilogue.params] + list(g.epilogue.tied_param_names)
        grad_h, loss_sum = [], torch.zeros((), dtype=torch.float32, device=self.device)
        for m, mb in enumerate(micro_batches):
            rows = mb.input_ids.shape[0]
            step = min(rows, self.loss_chunk_rows or rows)
            grad_parts = []
            for r0 in range(0, rows, step):  # the loss in row chunks: logits of `step` rows at a time
                part = MicroBatch(mb.input_ids[r0 : r0 + step], mb.labels[r0 : r0 + step],
                                  None if mb.attention_mask is None else mb.attention_mask[r0 : r0 + step])
                last = hidden[m][r0 : r0 + step].detach().requires_grad_(True)

                def tail(index: int, call: BlockCall, last=last):
                    return wrap_block_output(last if index == self.n_blocks - 1 else call.hidden, g.block_output)

                with self.streams.range("epilogue"), proxied_blocks(self.model, g.blocks_path, tail):
                    with torch.enable_grad():
                        logits = logits_of(torch.func.functional_call(self.model, top, (part.input_ids,),
                                                                      _kwargs(g.forward_kwargs, part)))
                        loss = token_loss_sum(logits, part.labels) / global_tokens
                    del logits
                    grads = torch.autograd.grad(loss, [last] + [leaves[n] for n in epi_names], allow_unused=True)
                grad_parts.append(grads[0] if grads[0] is not None else torch.zeros_like(last))
                self._accumulate(resident_acc, epi_names, grads[1:])
                loss_sum = loss_sum + loss.detach()
            hidden[m] = None
            grad_h.append(torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0])
        return grad_h, loss_sum

    def _accumulate(self, resident_acc, names, grads) -> None:
        for name, gp in zip(names, grads):
            if gp is not None:
                lid, start, numel = self.locate[name]
                resident_acc[lid][start : start + numel].add_(gp.reshape(-1).float())

    def _drain(self, layer_id: int, acc: torch.Tensor) -> tuple[torch.Tensor, Guard]:
        """Sum of squares of a layer's gradient, then its D2H copy into the host gradient."""
        sumsq = torch.dot(acc, acc) if acc.numel() else torch.zeros((), device=self.device)
        host_grad = self.host.layers[layer_id].grad
        src = acc if host_grad.dtype == torch.float32 else acc.to(host_grad.dtype)
        self.streams.wait("d2h", self.streams.record("compute"))
        dst = self._targets[layer_id]
        for lo, hi in chunk_bounds(acc.numel(), self.chunks[layer_id]):
            guard = self.streams.copy("d2h", dst[lo:hi], src[lo:hi])
        return sumsq, guard


@dataclass
class KeptForward:
    """A kept block's forward for one micro-batch: its input leaf, output and graph's weights."""

    x: torch.Tensor
    out: torch.Tensor
    params: dict[str, torch.Tensor]
    saved: SavedActivations


def chunk_bounds(numel: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` nearly equal contiguous pieces of [0, numel) (fewer if numel is smaller)."""
    chunks = max(1, min(chunks, numel)) if numel else 1
    size = -(-numel // chunks)
    return [(lo, min(lo + size, numel)) for lo in range(0, max(numel, 1), size)] if numel else [(0, 0)]


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
