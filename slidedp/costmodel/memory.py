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


# fp32 block gradient buffers on the device at once: one filling (the block in backward), one draining
# (the previous block's, on its way to the host); a block's backward waits for the one before those.
GRAD_ACCUMULATORS = 2


def grad_accumulators_bytes(max_block_numel: int) -> int:
    """GRAD_ACCUMULATORS fp32 gradient accumulators (one filling, one draining): 2 * numel * 4."""
    return GRAD_ACCUMULATORS * max_block_numel * 4


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


# Parameters a device-state layer's AdamW takes at once (backend/state/device_state.py): its gradient
# is copied to fp32 one piece at a time, on the update stream, at the step boundary.
DEVICE_STATE_PIECE_NUMEL = 1 << 24


def device_update_piece_bytes(shares) -> int:
    """The device-state update's fp32 copy of one piece's gradient, for layers of `shares` parameters each
    (per rank): a whole piece (64 MiB) or the largest share where smaller; 0 without device state. It is
    alive beside the next step's first positions while the update stream runs."""
    return 4 * min(DEVICE_STATE_PIECE_NUMEL, max(shares, default=0))


# -- vocabulary-streamed prologue and epilogue -----------------------------------------------------
# A prologue or epilogue whose vocabulary table (embedding, head or the table they tie, [vocab, hidden])
# is streamed (docs/design.md §4.14) keeps only its other parameters resident; the table crosses in row
# ranges of at most this many parameters (64 MiB in bf16), through two device slots.
VOCAB_CHUNK_NUMEL = 1 << 25


def vocab_chunk_rows(vocab_size: int, hidden_size: int, chunk_numel: int = VOCAB_CHUNK_NUMEL) -> int:
    """Rows of one vocabulary chunk: the table cut into ceil(V * H / chunk_numel) nearly equal row ranges."""
    pieces = max(1, -(-vocab_size * hidden_size // max(1, chunk_numel)))
    return -(-vocab_size // pieces)


# PyTorch's CUDA embedding backward sums the lookups of each row in partial sums of at most this many,
# in an fp32 buffer sized for the most partials there can be: tokens / 10 + min(tokens, rows) rows.
EMBEDDING_BACKWARD_ROWS_PER_PARTIAL = 10


def embedding_backward_workspace_rows(tokens: int, rows: int) -> int:
    """Rows of the fp32 partial sums of one embedding backward of `tokens` lookups into `rows` rows."""
    return tokens // EMBEDDING_BACKWARD_ROWS_PER_PARTIAL + min(tokens, rows) + 1


# A resident embedding table's fp32 weight gradient is made in row ranges of at most this many parameters
# (256 MiB; backend/runtime/embedding_grads.py): each range's kernel reads every lookup's gradient, so
# fewer, larger ranges cost less time and more memory.
EMBEDDING_GRAD_CHUNK_NUMEL = 1 << 26


def embedding_grad_chunk_rows(rows: int, hidden_size: int) -> int:
    """Rows of one range of a resident embedding table's weight gradient (EMBEDDING_GRAD_CHUNK_NUMEL)."""
    return vocab_chunk_rows(rows, hidden_size, EMBEDDING_GRAD_CHUNK_NUMEL)


def _lookups_bytes(tokens: int, rows: int, hidden_size: int) -> int:
    """One embedding backward of `tokens` lookups into `rows` rows beyond the rows themselves: their
    output gradients in fp32, the kernel's partial sums (embedding_backward_workspace_rows), and 64 B a
    lookup for the indices (theirs, each one's row within a range, the kernel's sorted copies)."""
    return (tokens + embedding_backward_workspace_rows(tokens, rows)) * hidden_size * 4 + tokens * 64


def embedding_grad_bytes(tokens: int, rows: int, hidden_size: int) -> int:
    """Device memory of one resident embedding table's weight gradient over a pass
    (backend/runtime/embedding_grads.py), from `tokens` lookups (every micro-batch's): one row range's
    fp32 gradient of `embedding_grad_chunk_rows(rows, hidden_size)` rows plus the spare row that takes
    the lookups outside it, and the lookups' own bytes (_lookups_bytes)."""
    chunk = embedding_grad_chunk_rows(rows, hidden_size) + 1
    return chunk * hidden_size * 4 + _lookups_bytes(tokens, chunk, hidden_size)


def prologue_backward_bytes(params, micro_batches: int, tokens: int, streamed_name: str | None = None,
                            streamed_rows: int = 0) -> int:
    """The prologue's backward beyond its resident buffers, for `micro_batches` of `tokens` tokens: the
    largest `embedding_grad_bytes` of its [rows, hidden] parameters (`params`: ParamInfo; each a possible
    embedding table, made one after another) over every micro-batch's lookups. A streamed table
    (`streamed_name`, `streamed_rows` a chunk) makes its gradient in its chunk buffers (vocab_stream_bytes),
    one micro-batch's lookups at a time (_lookups_bytes)."""
    out = 0
    for p in params:
        if len(p.shape) != 2:
            continue
        rows, hidden = p.shape
        if p.name == streamed_name:
            need = _lookups_bytes(tokens, streamed_rows, hidden)
        else:
            need = embedding_grad_bytes(micro_batches * tokens, rows, hidden)
        out = max(out, need)
    return out


# A streamed table's chunk gradients are made in this many fp32 buffers used in turn: a buffer is made
# again only once the D2H stream has taken what was sent from it, so one chunk's gradient goes down
# while the next is made, and no more are held however far the host runs ahead of the copies.
VOCAB_GRAD_BUFFERS = 2


def vocab_stream_bytes(chunk_rows: int, hidden_size: int, elem_bytes: int) -> int:
    """Device buffers of one vocabulary-streamed layer while it runs: two weight slots of a chunk in
    the compute dtype, VOCAB_GRAD_BUFFERS fp32 chunk gradients, and a cast copy on the way down (bf16
    only): chunk * (2 * elem + 2 * 4 + elem) bytes, chunk = chunk_rows * hidden (none of it whole-table)."""
    chunk = chunk_rows * hidden_size
    return chunk * (2 * elem_bytes + VOCAB_GRAD_BUFFERS * 4 + (elem_bytes if elem_bytes != 4 else 0))


def streamed_epilogue_working_bytes(tokens: int, hidden_size: int, chunk_rows: int, elem_bytes: int,
                                    loss_chunk_tokens: int, micro_batches: int) -> int:
    """Final norm, head and loss of a pass whose head streams by vocabulary chunk (every micro-batch
    at once: each chunk is loaded once per pass for the forward and once for the backward;
    backend/runtime/vocab_stream.py head_loss).

    Held for every micro-batch: tokens * hidden * (3 * elem + 8) (final hidden state, its norm, its
    gradient, the norm's fp32 copy of its input and the fp32 sum of the hidden-state gradient over
    the chunks) and tokens * 16 (fp32 logsumexp, target logit, coefficient; int64 chunk-local labels).
    On top, the larger of: one chunk's backward, tokens * hidden * elem (its hidden-state gradient)
    beside the larger of T * chunk_rows * elem (its dlogits for T = min(loss_chunk_tokens, tokens)
    tokens; the forward writes no logits) and tokens * hidden * 4 (the gradient's fp32 copy, made once
    the dlogits are freed, added to the sum); and one micro-batch's final-norm backward, tokens *
    hidden * 6 * 4 (as in `epilogue_working_bytes`: the micro-batches take theirs one after another).
    """
    chunk = min(loss_chunk_tokens, tokens)
    held = micro_batches * (tokens * hidden_size * (3 * elem_bytes + 8) + tokens * 16)
    chunk_backward = tokens * hidden_size * elem_bytes + max(chunk * chunk_rows * elem_bytes, tokens * hidden_size * 4)
    return held + max(chunk_backward, tokens * hidden_size * 6 * 4)


def device_state_shard_numel(numel: int, chunks: int, world_size: int) -> int:
    """Parameters of a device-state layer the busiest rank keeps when the state is sharded by chunk
    owner: `chunks` pieces of ceil(numel / chunks) (the last shorter), dealt round-robin over the
    ranks, so a rank owns at most ceil(pieces / W) of them: min(numel, ceil(pieces / W) * size)."""
    if numel <= 0:
        return 0
    size = -(-numel // max(1, min(chunks, numel)))
    pieces = -(-numel // size)
    return min(numel, -(-pieces // world_size) * size)


def device_state_shard_bytes(numel: int, elem_bytes: int, chunks: int, world_size: int) -> int:
    """`device_state_bytes` of the busiest rank's shard (device_state_shard_numel), about 1/W of it."""
    return device_state_bytes(device_state_shard_numel(numel, chunks, world_size), elem_bytes)


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


def logit_bytes(elem_bytes: int, fused: bool) -> int:
    """Device bytes per logit of one loss chunk. fused (the model's logits are its linear head's plain
    output: backend/kernels/linear_cross_entropy.py's Triton path): the fp32 logits and the dlogits in
    the compute dtype, 4 + elem. Otherwise the model's own logits through autograd: the logits and their
    gradient in the compute dtype, the fp32 log-softmax and its gradient, 2 * elem + 8."""
    return 4 + elem_bytes if fused else 2 * elem_bytes + 8


def epilogue_working_bytes(tokens: int, hidden_size: int, vocab_size: int, elem_bytes: int,
                           loss_chunk_tokens: int, *, fused: bool) -> int:
    """Final norm, head and chunked cross-entropy of one micro-batch: the larger of its two phases.

    Forward and loss: tokens * hidden * (3 * elem + 4) (final hidden state, its norm, its gradient
    and the norm's fp32 copy of its input) plus, for one chunk of T = min(loss_chunk_tokens, tokens)
    tokens, T * vocab * logit_bytes(elem, fused).
    Backward of the final norm: tokens * hidden * (3 * elem + 6 * 4): a norm computed in fp32 (as
    Llama's and Qwen's RMSNorm upcast) keeps its fp32 input and its backward holds five fp32
    temporaries at once (measured on Qwen3-4B at 262,144 tokens; benchmarks/LOG.md), beside the
    gradient from the loss and the embedding output the model's own forward recomputes.
    """
    chunk = min(loss_chunk_tokens, tokens)
    forward = tokens * hidden_size * (3 * elem_bytes + 4) + chunk * vocab_size * logit_bytes(elem_bytes, fused)
    return max(forward, tokens * hidden_size * (3 * elem_bytes + 6 * 4))


# -- host RAM ---------------------------------------------------------------------------------------
# The one count of host bytes: the host state's layout (backend/state/host_state.py plan_layout
# allocates exactly host_state_bytes), the planner's host budget (scheduler) and compile's preflight
# (run/preflight.py) all read it here.

HOST_PAGE_BYTES = 4096  # every host array starts on a page
HOST_STAGING_SLOTS = 4  # pinned gradient staging buffers per rank (backend/runtime/routes.py)
# The host buffer through which the state kept on a one-rank engine's device is loaded (initial
# weights, checkpoints) and saved (checkpoints), one piece at a time (backend/state/staging.py).
LOAD_STAGING_BYTES = 64 << 20


def _page(nbytes: int) -> int:
    return -(-nbytes // HOST_PAGE_BYTES) * HOST_PAGE_BYTES


def chunk_bounds(numel: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """`chunks` nearly equal contiguous pieces of [0, numel) (fewer if numel is smaller)."""
    if numel == 0:
        return ((0, 0),)
    chunks = max(1, min(chunks, numel))
    size = -(-numel // chunks)
    return tuple((lo, min(lo + size, numel)) for lo in range(0, numel, size))


def chunk_owners(owners, n_chunks: int, world_size: int) -> tuple[int, ...]:
    """The rank updating each of `n_chunks` chunks: the plan's `owners`, else chunk c by rank c mod W."""
    return tuple(owners[c] if c < len(owners) else c % world_size for c in range(n_chunks))


def held_runs(bounds, owners, ranks) -> tuple[tuple[int, int], ...]:
    """The element runs [lo, hi) of a layer held by a host whose ranks are `ranks`: its chunks
    (`bounds`, one owner each) owned by one of them, adjacent ones merged."""
    ranks, runs = set(ranks), []
    for (lo, hi), owner in zip(bounds, owners):
        if owner not in ranks or hi <= lo:
            continue
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return tuple(runs)


def host_held_numels(layers, world_size: int, hosts: int, host: int, whole=()) -> list[int]:
    """Parameters per layer that host `host` of `hosts` (ranks numbered host by host) holds in its
    host state: `layers` as (numel, chunks, owners) in layer order; a layer in `whole` (indices of the
    layers whose state every rank keeps on its device) whole on every host; one host holds all."""
    if hosts == 1:
        return [numel for numel, _, _ in layers]
    G = world_size // hosts
    ranks = range(host * G, (host + 1) * G)
    out = []
    for i, (numel, chunks, owners) in enumerate(layers):
        if i in set(whole):
            out.append(numel)
            continue
        bounds = chunk_bounds(numel, chunks)
        out.append(sum(hi - lo for lo, hi in held_runs(bounds, chunk_owners(owners, len(bounds), world_size), ranks)))
    return out


def step_flag_ints(world_size: int, n_layers: int) -> int:
    """int64 counters of the host state's control region (backend/state/step_flags.py)."""
    return 1 + (world_size + 1) * n_layers


def host_layer_bytes(numel: int, elem_bytes: int, *, lean: bool = False, copy: bool = True, grad: bool = True) -> int:
    """One layer of the host state, page-aligned arrays: fp32 master (4 B per parameter), both AdamW
    moments (8 B), the delivery copy in the compute dtype (2 B in bf16; none in fp32, where H2D reads
    the master, nor where `copy` is False: made on load) and the gradient (elem B; none where `grad`
    is False: streamed into the update): 16 B per parameter in bf16, 12 with neither. A lean layer (its
    optimizer state, master weights included, on the device of a one-rank engine) takes nothing: 0 B."""
    if lean:
        return 0
    arrays = [numel * 4, numel * 4, numel * 4]
    arrays += [numel * elem_bytes] if elem_bytes != 4 and copy else []
    arrays += [numel * elem_bytes] if grad else []
    return sum(_page(a) for a in arrays)


def host_grad_bytes(numel: int, elem_bytes: int) -> int:
    """The gradient of a host layer (page-aligned): what streaming it into the update saves."""
    return _page(numel * elem_bytes)


def host_copy_bytes(numel: int, elem_bytes: int) -> int:
    """The delivery copy of a host layer (page-aligned): what making it on load saves (0 in fp32)."""
    return 0 if elem_bytes == 4 else _page(numel * elem_bytes)


def host_spare_bytes(numel: int) -> int:
    """The spare fp32 master and moments of a layer updated early (12 B per parameter)."""
    return 3 * _page(numel * 4)


def host_state_bytes(numels, elem_bytes: int, *, lean=(), spare=(), no_copy=(), no_grad=(),
                     control_ints: int = 0) -> int:
    """Bytes of the whole host state: every layer (`numels[i]` parameters; the indices in `lean` lean,
    those in `spare` with a spare copy, those in `no_copy` without a delivery copy, those in `no_grad`
    without a gradient), then the control region of `control_ints` counters."""
    lean, spare, no_copy, no_grad = set(lean), set(spare), set(no_copy), set(no_grad)
    total = sum(host_layer_bytes(n, elem_bytes, lean=i in lean, copy=i not in no_copy, grad=i not in no_grad)
                + (host_spare_bytes(n) if i in spare else 0) for i, n in enumerate(numels))
    return max(total + _page(control_ints * 8), HOST_PAGE_BYTES)


def host_staging_bytes(max_chunk_numel: int, elem_bytes: int, world_size: int) -> int:
    """Pinned staging of the gradients on their way to the host: HOST_STAGING_SLOTS buffers of the
    largest chunk per rank, in the gradient's dtype."""
    return world_size * HOST_STAGING_SLOTS * max_chunk_numel * elem_bytes


def load_staging_bytes(lean) -> int:
    """The host staging of the lean layers' state on its way to and from the device (initial weights,
    checkpoints): LOAD_STAGING_BYTES when there is a lean layer, else 0."""
    return LOAD_STAGING_BYTES if len(tuple(lean)) else 0


def host_memory(numels, elem_bytes: int, *, world_size: int, lean=(), spare=(), no_copy=(), no_grad=(),
                offloaded_bytes: int = 0, max_chunk_numel: int = 0) -> dict[str, int]:
    """Host RAM of a plan by category (bytes, all ranks): "state" (the host state with its control
    region; nothing for the lean layers, no delivery copy for those in `no_copy`, no gradient for those
    in `no_grad`), "spare" (early updates' spare state),
    "offloaded_activations" (pinned, `offloaded_bytes` for all ranks), "pinned_buffers" (gradient
    staging) and "load_staging" (the lean layers' bounded staging, `load_staging_bytes`). Their sum
    is the plan's peak_host_bytes."""
    state = host_state_bytes(numels, elem_bytes, lean=lean, no_copy=no_copy, no_grad=no_grad,
                             control_ints=step_flag_ints(world_size, len(numels)))
    return {"state": state, "spare": sum(host_spare_bytes(numels[i]) for i in set(spare)),
            "offloaded_activations": int(offloaded_bytes),
            "pinned_buffers": host_staging_bytes(max_chunk_numel, elem_bytes, world_size),
            "load_staging": load_staging_bytes(lean)}
