"""Device memory of one rank over program order: at each compute position, the bytes held.

Memory depends on the decisions only, not on timing: the program fixes when each buffer is
allocated and freed relative to the compute ops (the transfers that free a buffer are waited for
before the compute that reuses it, see program.py). At compute position x:

  mem(x) = resident weights + resident fp32 gradients (a streamed table's not: its layer's chunk
           buffers at its own positions instead) + window * largest block
           + 2 fp32 block gradient accumulators + max over layers of its gradient staging
           + the optimizer state of the layers that keep it on the device (costmodel.memory; a decision:
             LayerChoice.on_device, added to these terms by `evaluate` and the CP-SAT model)
           + the slots of streamed updates, if any (allocated once, held throughout)
           + boundary stash(x) * m + working set(x)
           + sum over kept blocks i with fwd_i <= x <= bwd_i of m * saved_i
           + sum over offloaded blocks i with x in {fwd_i, fwd_i + 1, bwd_i - 1, bwd_i} of m * saved_i
           - sum over recompute_offload blocks i >= 2 whose block i - 1 recomputes (recompute or
             recompute_offload), with fwd_i + 2 <= x <= bwd_i - 2, of m * boundary

stash(x) counts the boundary activations alive (every block's input until its backward, plus the
tensors in flight): 1 at the prologue, i + 1 at block i's forward, N + 2 at the epilogue, i + 2 at
block i's backward, 2 at the prologue's backward. A recompute_offload block's input is on the device
only in the same transit window as an offloaded block's buffers (its copy down lands before the
forward two blocks later; its copy up starts after the compute two positions before its backward).
Its input is the output of block i - 1, which that block's graph holds until its backward when it
keeps or offloads (its output is the root of its backward), and block 1's input is the prologue's
output, which the prologue's backward holds: then the input stays on the device whatever the policy. The working set is the block's
peak_workspace_bytes (in the backward plus its parameter gradients in the compute dtype, and one
micro-batch of its saved activations while it is recomputed), the chunked loss at the
epilogue (costmodel.memory.epilogue_working_bytes) and the embedding tables' weight gradients at the
prologue's backward (costmodel.memory.prologue_backward_bytes). backend/lowering/program.py allocates the same buffers
(from the same costmodel.memory functions), so a lowered program never needs more than this.

Both the simulator (evaluating it) and the CP-SAT model (as linear constraints) use `terms`.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.scheduler.problem.costs import ProblemCosts
from slidedp.scheduler.decisions import KEEP, OFFLOAD, RECOMPUTED, Decisions
from slidedp.scheduler.plan import input_offloaded

CATEGORIES = ("resident_params_bytes", "resident_grads_bytes", "weight_slots_bytes", "grad_accumulators_bytes",
              "grad_staging_bytes", "boundary_stash_bytes", "kept_activation_bytes", "offload_buffers_bytes",
              "working_bytes", "device_state_bytes", "streamed_update_bytes", "vocab_stream_bytes")


@dataclass(frozen=True)
class PositionTerms:
    position: int
    key: str  # the compute op at this position
    base: tuple[tuple[str, int], ...]  # (category, bytes) that no block's activation policy changes
    keep: tuple[tuple[int, int], ...]  # (block id, bytes) held here if that block keeps: blocks 1..keep_upto
    offload: tuple[tuple[int, int], ...]  # ... if it offloads
    recompute: tuple[tuple[int, int], ...]  # ... if it recomputes (recompute, recompute_offload)
    # (block id, bytes) of the boundary stash not held here if that block offloads its input
    # (recompute_offload) and the block before it recomputes (plan.input_offloaded)
    unstashed: tuple[tuple[int, int], ...] = ()

    @property
    def base_bytes(self) -> int:
        return sum(b for _, b in self.base)

    @property
    def keep_upto(self) -> int:
        return len(self.keep)


def terms(costs: ProblemCosts, window: int, compute_keys: tuple[str, ...]) -> tuple[PositionTerms, ...]:
    """Memory terms at every compute position (the staging maximum and the device state are added
    separately)."""
    key = ("footprint.terms", window)
    if key not in costs.cache:
        costs.cache[key] = _terms(costs, window, compute_keys)
    return costs.cache[key]


def vocab_memory_deltas(costs: ProblemCosts, window: int, compute_keys: tuple[str, ...]) -> dict:
    """Where the tables that stream are a decision (ProblemCosts.vocab_groups): per literal group, per
    compute position, the device bytes its table's streaming adds to the resident problem's base
    (`terms`; negative: it frees them); the choices' terms are asserted to be the resident ones plus
    the deltas of their groups."""
    key = ("footprint.vocab_memory_deltas", window)
    if key in costs.cache:
        return costs.cache[key]
    base = terms(costs, window, compute_keys)
    deltas = {}
    for group in costs.vocab_groups:
        other = terms(costs.variants[frozenset(group)], window, compute_keys)
        deltas[group] = tuple(o.base_bytes - b.base_bytes for o, b in zip(other, base))
    for choice, variant in costs.variants.items():
        other = terms(variant, window, compute_keys)
        for x, (o, b) in enumerate(zip(other, base)):
            assert (o.position, o.keep, o.offload, o.recompute, o.unstashed) == \
                (b.position, b.keep, b.offload, b.recompute, b.unstashed)
            assert o.base_bytes == b.base_bytes + sum(deltas[g][x] for g in costs.vocab_groups
                                                      if set(g) <= choice), (choice, x)
    costs.cache[key] = deltas
    return deltas


def _terms(costs: ProblemCosts, window: int, compute_keys: tuple[str, ...]) -> tuple[PositionTerms, ...]:
    N, m = costs.n_blocks, costs.problem.micro_batches
    static = (("resident_params_bytes", costs.resident_params_bytes),
              ("resident_grads_bytes", costs.resident_grads_bytes),
              ("weight_slots_bytes", costs.weight_slots_bytes(window)),
              ("grad_accumulators_bytes", costs.grad_accumulators_bytes))
    out = []
    for x, key in enumerate(compute_keys):
        if x == 0:
            stash, work = 1, 0
        elif x <= N:
            stash, work = x + 1, costs.blocks[x].workspace_bytes
        elif x == N + 1:
            stash, work = N + 2, costs.epilogue_working_bytes
        elif x < 2 * N + 2:
            i = 2 * N + 2 - x
            stash, work = i + 2, costs.blocks[i].workspace_bytes + costs.blocks[i].param_grads_bytes
        else:
            stash, work = 2, costs.prologue_working_bytes
        keep, offload, recompute, unstashed = [], [], [], []
        for i, b in costs.blocks.items():
            held = m * b.saved_bytes
            fwd, bwd = i, 2 * N + 2 - i
            if fwd <= x <= bwd:
                keep.append((i, held))
            if x in {fwd, fwd + 1, bwd - 1, bwd}:
                offload.append((i, held))
            if x == bwd:
                recompute.append((i, b.saved_bytes))
            if i >= 2 and fwd + 2 <= x <= bwd - 2:
                unstashed.append((i, m * costs.boundary_bytes))
        assert [i for i, _ in keep] == list(range(1, len(keep) + 1)), "kept blocks at a position are 1..j"
        # a streamed table's slots, chunk gradient and its cast, while its layer runs
        owner = costs.epilogue_id if x == N + 1 else 0 if x in (0, 2 * N + 2) else None
        vocab = costs.vocab_stream_bytes.get(owner, 0)
        base = static + (("boundary_stash_bytes", stash * m * costs.boundary_bytes), ("working_bytes", work),
                         ("vocab_stream_bytes", vocab))
        out.append(PositionTerms(x, key, base, tuple(keep), tuple(offload), tuple(recompute), tuple(unstashed)))
    return tuple(out)


@dataclass(frozen=True)
class Footprint:
    per_position: tuple[int, ...]  # device bytes at each compute position
    peak_bytes: int
    peak_position: int
    breakdown: dict  # category -> bytes at the peak position (sums to peak_bytes)


def evaluate(costs: ProblemCosts, decisions: Decisions, compute_keys: tuple[str, ...]) -> Footprint:
    """mem(x) at every position for these decisions, and the breakdown of the peak (with the costs of
    their choice of streamed tables: ProblemCosts.variant)."""
    costs = costs.variant(decisions)
    activation = {i: decisions.layers[i].activation for i in costs.blocks}
    staging = max(costs.option_of(i, c).staging_bytes
                  for i, c in enumerate(decisions.layers))
    device_state = costs.device_state_bytes(decisions.device_state)
    m = costs.problem.micro_batches
    kept_prefix = [0]  # bytes kept by blocks 1..j (the blocks held at a position are always 1..j)
    for i in sorted(costs.blocks):
        kept_prefix.append(kept_prefix[-1] + (m * costs.blocks[i].saved_bytes if activation[i] == KEEP else 0))
    totals, parts = [], []
    for t in terms(costs, decisions.window, compute_keys):
        part = dict.fromkeys(CATEGORIES, 0)
        for name, b in t.base:
            part[name] += b
        part["grad_staging_bytes"] = staging
        part["device_state_bytes"] = device_state
        part["streamed_update_bytes"] = costs.streamed_update_bytes if decisions.streamed else 0
        part["kept_activation_bytes"] = kept_prefix[t.keep_upto]
        for (i, b) in t.offload:
            if activation[i] == OFFLOAD:
                part["offload_buffers_bytes"] += b
        for (i, b) in t.recompute:
            if activation[i] in RECOMPUTED:
                part["working_bytes"] += b
        for (i, b) in t.unstashed:
            if input_offloaded(activation, i):
                part["boundary_stash_bytes"] -= b
        totals.append(sum(part.values()))
        parts.append(part)
    peak_x = max(range(len(totals)), key=lambda x: (totals[x], -x))
    return Footprint(tuple(totals), totals[peak_x], peak_x, parts[peak_x])
