"""The device buffers of the streamed program, each a small function of its size (bytes per rank).

The scheduler (scheduler/problem/footprint.py) places them in program order to get memory over a step.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resident_layer_bytes(numel: int, elem_bytes: int) -> tuple[int, int]:
    """Prologue + epilogue: weights in the compute dtype and their fp32 gradient accumulator,
    (numel * elem, numel * 4), held the whole step."""
    return numel * elem_bytes, numel * 4


def weight_slots_bytes(max_block_numel: int, elem_bytes: int, window: int) -> int:
    """`window` device slots, each the largest block in the compute dtype: window * numel * elem."""
    return window * max_block_numel * elem_bytes


def grad_accumulators_bytes(max_block_numel: int) -> int:
    """Two fp32 gradient accumulators (one filling, one draining): 2 * numel * 4."""
    return 2 * max_block_numel * 4


def param_grads_bytes(numel: int, elem_bytes: int) -> int:
    """Autograd's gradients of one block's parameters in the compute dtype, alive during the block's
    backward until they are summed into the fp32 accumulator: numel * elem."""
    return numel * elem_bytes


def grad_staging_bytes(numel: int, elem_bytes: int, chunks: int, world_size: int, reduction: str) -> int:
    """Device staging of one layer's gradient on its way to the host.

    cpu reduction: the fp32 accumulator is cast chunk by chunk on the D2H stream, each chunk into a
    fresh buffer freed once its copy is done; with one cast ahead of the copy in flight that is
    2 * ceil(numel / chunks) * elem; nothing in fp32 (copied directly).
    gpu reduction: the cast copy (numel * elem, none in fp32) plus the summed shard after the
    reduce-scatter, ceil(numel / W) * elem.
    """
    if reduction == "cpu":
        return 0 if elem_bytes == 4 else 2 * -(-numel // chunks) * elem_bytes
    cast = 0 if elem_bytes == 4 else numel * elem_bytes
    return cast + -(-numel // world_size) * elem_bytes


def device_state_bytes(numel: int, elem_bytes: int) -> int:
    """A layer whose optimizer state lives on the device: fp32 master and both moments (12 B per
    parameter) and the gradient in the compute dtype, as the host would hold it (the weights are
    cast from the master as they are copied into a slot)."""
    return numel * (12 + elem_bytes)


# Parameters per piece of a streamed update (backend/runtime/streamed_updates.py): 32 MiB of each fp32 array.
STREAMED_PIECE_NUMEL = 1 << 23
STREAMED_SLOTS = 2  # pieces in flight: one coming up while the one before is updated and goes down


def streamed_update_bytes(elem_bytes: int, piece_numel: int = STREAMED_PIECE_NUMEL) -> int:
    """Device buffers of the updates whose state streams through the device: STREAMED_SLOTS pieces of
    fp32 master and moments (12 B) with the gradient and the delivery copy (2 + 2 B in bf16; a 4 B
    gradient and no delivery copy in fp32), and the fp32 gradient AdamW reads (4 B, a bound):
    piece * (slots * 16 + 4)."""
    per_param = 12 + (2 * elem_bytes if elem_bytes != 4 else 4)
    return piece_numel * (STREAMED_SLOTS * per_param + 4)


def epilogue_working_bytes(tokens: int, hidden_size: int, vocab_size: int, elem_bytes: int,
                           loss_chunk_tokens: int) -> int:
    """Final norm, head and chunked cross-entropy of one micro-batch: the larger of its two phases.

    Forward and loss: tokens * hidden * (3 * elem + 4) (final hidden state, its norm, its gradient
    and the norm's fp32 copy of its input) plus, for one chunk of T = min(loss_chunk_tokens, tokens)
    tokens, T * vocab * (2 * elem + 8): the logits and their gradient in the compute dtype, the fp32
    log-softmax and its gradient.
    Backward of the final norm: tokens * hidden * (3 * elem + 6 * 4): a norm computed in fp32 (as
    Llama's and Qwen's RMSNorm upcast) keeps its fp32 input and its backward holds five fp32
    temporaries at once (measured on Qwen3-4B at 262,144 tokens; benchmarks/LOG.md), beside the
    gradient from the loss and the embedding output the model's own forward recomputes.
    """
    chunk = min(loss_chunk_tokens, tokens)
    forward = tokens * hidden_size * (3 * elem_bytes + 4) + chunk * vocab_size * (2 * elem_bytes + 8)
    return max(forward, tokens * hidden_size * (3 * elem_bytes + 6 * 4))
