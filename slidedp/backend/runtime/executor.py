"""The streamed step: runs a lowered Program (see program.py) with the model's own modules.

Order within one pass over the weights (layer-major, so each block is loaded once per pass for
forward and at most once more for backward, whatever the number of micro-batches):

  1. prologue, per micro-batch: the model's own forward with proxied blocks, stopped at the last
     block; records each block's arguments (masks, rotary tables, ...) and the first hidden state.
  2. blocks 0..N-1: load weights into a slot (H2D stream), run every micro-batch without autograd,
     keep each block's input (the boundary activation) for recomputation (recompute_offload: on the
     host until the backward of the block two later).
  3. epilogue, per micro-batch: the model's own forward again, the last block returning the final
     hidden state as a leaf; token-weighted cross-entropy; gradients of the head and that leaf.
  4. blocks N-1..0: recompute each micro-batch with autograd, backpropagate, accumulate parameter
     gradients in one flat fp32 buffer, take its sum of squares, copy it to the host (D2H stream).
  5. prologue backward (its embedding tables' gradients in one fp32 embedding backward over every
     micro-batch: embedding_grads.py); its gradient goes to the host last (the epilogue's went
     after step 3).

Numerics are the model's own: blocks run through `torch.func.functional_call` with device views
of the streamed weights. Prologue and epilogue weights stay resident for the whole step, but for a
vocabulary table the plan streams (vocab_stream.py).

With `compile_blocks`, every block's forward (without autograd when it is recomputed later, with
it in a kept or offloaded block's forward and in a recomputation) runs through `torch.compile` of
that same functional call: one compiled graph per grad mode and input shape serves every block of
the model (the weights are graph inputs, so the blocks do not recompile), fusing the elementwise
work between the matmuls and cutting the Python issued per block. The saved-tensor hooks of kept
and offloaded blocks (saved_activations.py) act on what the compiled graph saves for its backward
as they do on eager autograd's saved tensors.

StreamedExecutor interprets the Program's ops; the work is its collaborators': the weights
(weight_window.py), the blocks' forward and backward under their activation policy
(block_runner.py), the prologue (prologue.py), the epilogue and loss (epilogue.py), and the
pass's gradients up to their copy to the host (pass_gradients.py); what a pass carries between
ops is a PassState (pass_state.py).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from slidedp.backend.lowering.program import (
    ALLOC, BWD, D2H_GRAD, D2H_INPUT, D2H_SAVED, EPILOGUE, FREE, FWD, H2D_INPUT, H2D_SAVED, H2D_WEIGHTS, PROLOGUE,
    PROLOGUE_BWD, Program,
)
from slidedp.backend.runtime.block_runner import BlockRunner
from slidedp.backend.runtime.epilogue import Epilogue
from slidedp.backend.runtime.pass_state import MicroBatch, PassState
from slidedp.backend.runtime.prologue import Prologue
from slidedp.backend.runtime.routes import Routes
from slidedp.backend.runtime.saved_activations import HostArena
from slidedp.backend.runtime.streams import Streams
from slidedp.backend.runtime.weight_slots import WeightWindow
from slidedp.backend.state.host_state import HostState
from slidedp.ir.blocks import find_blocks
from slidedp.ir.graph import BLOCK, LayerGraph

__all__ = ["MicroBatch", "StreamedExecutor"]


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
        self.window = program.n_slots
        self.activation = [op.policy for op in program.ops if op.kind == FWD]
        self.loss_chunk_tokens = loss_chunk_tokens
        self.compile_blocks = compile_blocks
        self.weights = WeightWindow(model, graph, host, self.routes, self.streams, blocks=self.blocks,
                                    block_layers=self.block_layers, n_slots=self.window, device=device,
                                    compute_dtype=compute_dtype, vocab_streamed=program.vocab_streamed,
                                    vocab_chunk_rows=program.vocab_chunk_rows)
        self.prologue = Prologue(model, graph, self.weights, self.n_blocks)
        self.epilogue = Epilogue(model, graph, self.weights, self.n_blocks, loss_chunk_tokens=loss_chunk_tokens)
        self.block_runner = BlockRunner(self.blocks, self.block_layers, self.weights, self.streams, self.activation,
                                        device=device, compile_blocks=compile_blocks)
        # The window's state, read by the rank (resident_stale after an update) and by tests.
        w = self.weights
        self.resident_ids, self.resident_stale, self.locate = w.resident_ids, w.resident_stale, w.locate
        self.resident, self.slots = w.resident, w.slots
        self.top_constants, self.block_constants = w.top_constants, w.block_constants
        self.head, self.epilogue_names = self.epilogue.head, self.epilogue.names
        # host time spent issuing the blocks' forwards and backwards (every micro-batch), since the rank
        # began [s], wall time (a full launch queue's waits included): {"fwd": s, "bwd": s}
        self.block_issue_s = {FWD: 0.0, BWD: 0.0}

    # -- what others read and set on the executor, held by its collaborators -------------------
    @property
    def call_block(self):
        return self.block_runner.call_block

    @property
    def fused_head(self) -> bool | None:
        """Whether the loss is the fused linear + cross-entropy (None until the first epilogue)."""
        return self.epilogue.fused_head

    @fused_head.setter
    def fused_head(self, value: bool | None) -> None:
        self.epilogue.fused_head = value

    @property
    def min_offload_bytes(self) -> int:
        """Saved tensors smaller than this stay on the device."""
        return self.block_runner.min_offload_bytes

    @min_offload_bytes.setter
    def min_offload_bytes(self, value: int) -> None:
        self.block_runner.min_offload_bytes = value

    @property
    def offloaded_bytes(self) -> int:
        """Activation bytes offloaded to the host in the last pass."""
        return self.block_runner.offloaded_bytes

    @offloaded_bytes.setter
    def offloaded_bytes(self, value: int) -> None:
        self.block_runner.offloaded_bytes = value

    @property
    def arena(self) -> HostArena | None:
        """Host memory of offloaded activations, made on first use."""
        return self.block_runner.arena

    def ensure_resident(self, layer_id: int) -> None:
        """H2D of a prologue/epilogue layer's weights if an update changed them since the last load."""
        self.weights.ensure_resident(layer_id)

    def close(self) -> None:
        """Release the host arena (unregistered first)."""
        self.block_runner.close()

    # -- the pass: interpret the program --------------------------------------------------------
    def run_pass(self, micro_batches: list[MicroBatch], global_tokens: int) -> torch.Tensor:
        """One pass over the weights; each layer's gradient goes to the host by `self.routes`.
        Returns the pass's loss: sum over its micro-batches of (token CE sum / global_tokens)."""
        st = PassState(self.model, self.graph, self.weights, self.n_blocks, micro_batches, global_tokens, self.device)
        self.block_runner.start_pass(len(micro_batches))
        events: dict[int, object] = {}
        handlers = {
            PROLOGUE: self._op_prologue, H2D_WEIGHTS: self._op_h2d_weights, FWD: self._op_fwd,
            EPILOGUE: self._op_epilogue, BWD: self._op_bwd, PROLOGUE_BWD: self._op_prologue_bwd,
            D2H_GRAD: self._op_d2h_grad, D2H_INPUT: self._op_d2h_input, H2D_INPUT: self._op_h2d_input,
            H2D_SAVED: self._op_h2d_saved,
            ALLOC: None, FREE: None,  # the caching allocator does these
            D2H_SAVED: None,  # the forward enqueued the copies on the d2h stream: the op's event marks them
        }
        for op in self.program.ops:
            for e in op.waits:
                self.streams.wait(op.stream, events[e])
            handler = handlers[op.kind]
            if handler is not None:
                t0 = time.perf_counter()
                with self.streams.range(op.text().split(None, 1)[1]):
                    handler(op, st)
                if op.kind in self.block_issue_s:
                    self.block_issue_s[op.kind] += time.perf_counter() - t0
            if op.record is not None:
                events[op.record] = self.streams.record(op.stream)
        return st.loss_sum

    def _op_prologue(self, op, st: PassState) -> None:
        """The model's forward up to the last block, per micro-batch: records every block's inputs."""
        self.prologue.forward(st)

    def _op_h2d_weights(self, op, st: PassState) -> None:
        self.weights.load_block(op.block, op.slot)

    def _op_fwd(self, op, st: PassState) -> None:
        """Forward of one block for every micro-batch, under the plan's activation policy."""
        self.block_runner.forward(op.block, op.slot, op.policy, st)

    def _op_epilogue(self, op, st: PassState) -> None:
        """Head and token-weighted loss per micro-batch; gradient of the last hidden state (epilogue.py)."""
        self.epilogue.run(st)

    def _op_bwd(self, op, st: PassState) -> None:
        """Backward of one block for every micro-batch; its gradient packed in one fp32 buffer."""
        self.block_runner.backward(op.block, op.slot, op.policy, st)

    def _op_d2h_input(self, op, st: PassState) -> None:
        """A recompute_offload block's input to the host (block_runner.py)."""
        self.block_runner.offload_input(op.block, st)

    def _op_h2d_input(self, op, st: PassState) -> None:
        """... and back to the device before its backward."""
        self.block_runner.reload_input(op.block, st)

    def _op_h2d_saved(self, op, st: PassState) -> None:
        """An offload block's saved activations back to the device before its backward (block_runner.py)."""
        self.block_runner.reload_saved(op.block, st)

    def _op_prologue_bwd(self, op, st: PassState) -> None:
        self.prologue.backward(st)

    def _op_d2h_grad(self, op, st: PassState) -> None:
        """The layer's fp32 gradient to the host by its reduction route (pass_gradients.py)."""
        st.grads.send(self.routes, op.layer_id)
        self.block_runner.grads.drain(op.layer_id, self.streams.record("d2h"))  # a block's buffer, read
