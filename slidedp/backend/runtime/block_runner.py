"""A block's forward and backward over every micro-batch, under the plan's activation policy.

recompute: the forward runs without autograd and keeps only the block's input; the backward
recomputes it with autograd. recompute_offload: the same, the input copied to the host arena after
the forward and back before the backward (the program's d2h_input / h2d_input ops; a block whose
input another graph holds keeps it on the device: plan.input_offloaded). keep / offload: the forward
runs with autograd and its graph lives until the backward, its saved tensors packed by
`SavedActivations` (offload: to the host arena, and back ahead of the backward by the h2d_saved op).
The backward sums the block's gradient over the micro-batches in one fp32 buffer (grad_buffers.py) by
the packing kernel, which also gives its sum of squares.
"""

from __future__ import annotations

import torch
from torch import nn

from slidedp.backend.kernels.grad_pack import pack_grads
from slidedp.backend.runtime.grad_buffers import GradientBuffers
from slidedp.backend.runtime.pass_state import KeptForward, PassState
from slidedp.backend.runtime.saved_activations import HostArena, SavedActivations
from slidedp.backend.runtime.streams import Streams
from slidedp.backend.runtime.weight_slots import WeightWindow
from slidedp.ir.blocks import unwrap_block_output
from slidedp.ir.graph import Layer
from slidedp.scheduler.plan import RECOMPUTED_ACTIVATIONS as RECOMPUTED, host_activation_bytes


class BlockRunner:
    """Runs the blocks of one rank (eager or compiled) and owns the host arena of offloaded activations."""

    def __init__(self, blocks: list[nn.Module], block_layers: list[Layer], weights: WeightWindow, streams: Streams,
                 activation: list[str], *, device: torch.device, compile_blocks: bool):
        self.blocks, self.block_layers, self.weights, self.streams = blocks, block_layers, weights, streams
        self.activation = activation  # per block, the plan's policy
        self.device = device
        self.call_block = torch.compile(run_block, dynamic=False) if compile_blocks else run_block
        self.min_offload_bytes = 1 << 16  # smaller saved tensors stay on the device
        self.offloaded_bytes = 0  # activation and block input bytes offloaded to the host in the last pass
        self.late_reload_bytes = 0  # offloaded activation bytes a backward copied back itself in the last pass
        self.arena: HostArena | None = None  # host memory of offloaded activations, made on first use
        self.grads = GradientBuffers(max(layer.numel for layer in block_layers), device, streams)

    def start_pass(self, micro_batches: int) -> None:
        """Count offloaded bytes from zero and hand out the arena from its start."""
        self.offloaded_bytes = self.late_reload_bytes = 0
        self.arena_for(micro_batches).reset()

    def forward(self, k: int, slot: int, policy: str, st: PassState) -> None:
        """Forward of block `k` (weights in `slot`) for every micro-batch, under `policy`."""
        module = self.blocks[k]
        params = self.weights.block_params(k, slot, requires_grad=policy not in RECOMPUTED)
        for m, call in enumerate(st.calls):
            if policy in RECOMPUTED:  # keep only the input; recompute in backward
                st.stash[k][m] = st.hidden[m]
                args, kwargs = call[k].with_hidden(st.hidden[m])
                with torch.no_grad():
                    out = self.call_block(module, params, args, kwargs)
                st.hidden[m] = unwrap_block_output(out)[0]
                continue
            x = st.hidden[m].detach().requires_grad_(True)
            saved = SavedActivations(self.weights.slots[slot], self.streams, offload=policy == "offload",
                                     min_offload_bytes=self.min_offload_bytes, arena=self.arena)
            args, kwargs = call[k].with_hidden(x)
            with torch.enable_grad(), saved.hooks():
                out = unwrap_block_output(self.call_block(module, params, args, kwargs))[0]
            st.kept[k][m] = KeptForward(x, out, params, saved)
            self.offloaded_bytes += saved.offloaded_bytes
            st.hidden[m] = out.detach()

    def backward(self, k: int, slot: int, policy: str, st: PassState) -> None:
        """Backward of block `k` (weights in `slot`) for every micro-batch; its gradient summed in one
        fp32 buffer by the packing kernel, which also gives the gradient's sum of squares (for exact clipping)."""
        layer = self.block_layers[k]
        module = self.blocks[k]
        acc = self.grads.take(layer.id, layer.numel)
        spans = self.weights.block_spans(k)
        if policy in RECOMPUTED:
            params = self.weights.block_params(k, slot, requires_grad=True)
        last = len(st.calls) - 1
        for m, call in enumerate(st.calls):
            if policy in RECOMPUTED:
                x = st.stash[k][m].detach().requires_grad_(True)
                st.stash[k][m] = None
                args, kwargs = call[k].with_hidden(x)
                with torch.enable_grad():
                    out = unwrap_block_output(self.call_block(module, params, args, kwargs))[0]
                leaves = params
            else:  # the forward's graph, its weights read from the slot that holds them now
                fwd, st.kept[k][m] = st.kept[k][m], None
                fwd.saved.slot = self.weights.slots[slot]
                x, out, leaves = fwd.x, fwd.out, fwd.params
            trainable = list(leaves.values())[: len(spans)]
            grads = torch.autograd.grad(out, [x] + trainable, st.grad_h[m], allow_unused=True)
            if policy not in RECOMPUTED:
                self.late_reload_bytes += fwd.saved.late_bytes
                del fwd
            st.grad_h[m] = grads[0]
            stats = pack_grads(grads[1:], spans, acc, [(0, layer.numel)] if m == last else (), accumulate=m > 0)
            del grads
        st.grads.finish_packed(layer.id, acc, stats.sumsq[0])

    def offload_input(self, k: int, st: PassState) -> None:
        """Block `k`'s input of every micro-batch to the host arena on the D2H stream (which waits for
        its forward); the device copy is released, reused by the allocator once the copy has landed."""
        for m, x in enumerate(st.stash[k]):
            host = self.arena.take(x.shape, x.dtype)
            if host is None:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.streams.cuda)
            self.streams.copy("d2h", host, x)
            st.stash[k][m] = host
            self.offloaded_bytes += x.numel() * x.element_size()

    def reload_input(self, k: int, st: PassState) -> None:
        """Block `k`'s input of every micro-batch back to the device on the H2D stream, allocated in that
        stream's memory (the compute stream reads it after waiting for the copy, and frees it)."""
        for m, host in enumerate(st.stash[k]):
            with self.streams.on("h2d"):
                x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            self.streams.copy("h2d", x, host)
            if self.streams.cuda:
                x.record_stream(self.streams.compute)
            st.stash[k][m] = x

    def reload_saved(self, k: int, st: PassState) -> None:
        """Block `k`'s offloaded activations of every micro-batch back to the device on the H2D stream,
        ahead of its backward (the program's h2d_saved op)."""
        for kept in st.kept[k]:
            kept.saved.reload(self.device)

    def arena_for(self, micro_batches: int) -> HostArena:
        """The host arena of offloaded activations and block inputs: what the offloading blocks put on
        the host per micro-batch (the IR's figures) times the micro-batches, allocated (and registered) once."""
        need = micro_batches * sum(host_activation_bytes(layer, policy)
                                   for layer, policy in zip(self.block_layers, self.activation))
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


def run_block(module: nn.Module, params: dict, args: tuple, kwargs: dict):
    """One block's forward with the given weights (what `compile_blocks` compiles)."""
    return torch.func.functional_call(module, params, args, kwargs)
