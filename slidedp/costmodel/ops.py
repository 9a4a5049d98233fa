"""The cost of each scheduled operation: small pure functions, each with its equation and units.

Units: bytes, seconds, FLOPs, parameters (numel). `W` is the number of data-parallel ranks on the
host. Shared host resources (a root complex's PCIe link, host DRAM, CPU cores) are modelled as
*shares*: the ranks run the same program in lockstep, so when one rank moves data all W do, and
each gets its share of the shared resource for the whole operation. Both the simulator and the
CP-SAT model use these functions and nothing else, so they agree by construction.
"""

from __future__ import annotations

import math

from slidedp.costmodel.hardware import Hardware
from slidedp.ir.graph import LayerCosts

# -- transfers ---------------------------------------------------------------------------------


def transfer_efficiency(nbytes: float, curve: tuple[tuple[int, float], ...]) -> float:
    """Fraction of the large-copy bandwidth reached by one copy of `nbytes` (dimensionless).

    Between measured sizes: linear in log2(bytes). Below the smallest: the copy is latency-bound
    (constant time), eff(s) = eff(s0) * s / s0. Above the largest: eff = the largest's value.
    """
    if nbytes <= 0:
        return 1.0
    s0, f0 = curve[0]
    if nbytes <= s0:
        return f0 * nbytes / s0
    for (sa, fa), (sb, fb) in zip(curve, curve[1:]):
        if nbytes <= sb:
            x = (math.log2(nbytes) - math.log2(sa)) / (math.log2(sb) - math.log2(sa))
            return fa + x * (fb - fa)
    return curve[-1][1]


def transfer_time_s(nbytes: float, bytes_per_s: float, curve: tuple[tuple[int, float], ...]) -> float:
    """One copy: t = nbytes / (bytes_per_s * eff(nbytes))  [s]; 0 for nothing to move."""
    if nbytes <= 0:
        return 0.0
    if bytes_per_s <= 0:
        raise ValueError("a transfer over a link of zero bandwidth")
    return nbytes / (bytes_per_s * transfer_efficiency(nbytes, curve))


def chunked_transfer_time_s(nbytes: float, chunks: int, bytes_per_s: float,
                            curve: tuple[tuple[int, float], ...]) -> float:
    """`chunks` equal copies back to back: t = chunks * transfer_time(nbytes / chunks)  [s]."""
    return chunks * transfer_time_s(nbytes / chunks, bytes_per_s, curve)


def ranks_per_link(hw: Hardware, world_size: int) -> int:
    """GPUs of the W ranks behind one root-complex link: k = min(W, gpus_per_root_complex)."""
    return max(1, min(world_size, hw.gpus_per_root_complex))


def link_share_bytes_per_s(direction_bytes_per_s: float, hw: Hardware, world_size: int,
                           directions: int = 1) -> float:
    """Per-rank DMA rate when all W ranks copy at once [bytes/s].

    r = min(direction / k, host_dram / (W * directions)), k = ranks_per_link(W): the k GPUs of a
    root complex split its link; the W ranks (times the directions moving at once) split host DRAM.
    """
    return min(direction_bytes_per_s / ranks_per_link(hw, world_size),
               hw.host_dram_bytes_per_s / (world_size * directions))


def h2d_bytes_per_s(hw: Hardware, world_size: int, *, duplex: bool) -> float:
    """Per-rank H2D rate [bytes/s]: alone, h2d; while D2H also runs (duplex), min(h2d, duplex/2).

    The forward's weight loads run alone unless activations are offloaded; the backward always has
    gradients going down while weights come up.
    """
    one_way = min(hw.h2d_bytes_per_s, hw.duplex_bytes_per_s / 2) if duplex else hw.h2d_bytes_per_s
    return link_share_bytes_per_s(one_way, hw, world_size, 2 if duplex else 1)


def d2h_bytes_per_s(hw: Hardware, world_size: int, *, duplex: bool = True) -> float:
    """Per-rank D2H rate [bytes/s]: min(d2h, duplex/2) while H2D also runs, else d2h; shared as above."""
    one_way = min(hw.d2h_bytes_per_s, hw.duplex_bytes_per_s / 2) if duplex else hw.d2h_bytes_per_s
    return link_share_bytes_per_s(one_way, hw, world_size, 2 if duplex else 1)


# -- compute -----------------------------------------------------------------------------------


def compute_flops_per_s(hw: Hardware) -> float:
    """Rate a transformer layer reaches: matmul_flops_per_s * block_efficiency  [FLOP/s]."""
    return hw.matmul_flops_per_s * hw.block_efficiency


def forward_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int) -> float:
    """Forward of one layer for every micro-batch: t = m * flops_fwd / rate  [s]."""
    return micro_batches * costs.flops_fwd / compute_flops_per_s(hw)


def recompute_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int) -> float:
    """Recomputing the forward before the backward costs the forward again: t = m * flops_fwd / rate."""
    return forward_time_s(costs, hw, micro_batches)


def backward_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int, *, recompute: bool) -> float:
    """Backward of one layer: t = m * (flops_bwd + [recompute] flops_fwd) / rate  [s]."""
    flops = costs.flops_bwd + (costs.flops_fwd if recompute else 0.0)
    return micro_batches * flops / compute_flops_per_s(hw)


def _compiled(hw: Hardware, compiled: bool) -> bool:
    """A compiled block whose rate was measured (compiled_block_efficiency > 0): its own rate and its
    own host floor (host_compiled_fwd_s / host_compiled_bwd_s); else the eager figures apply."""
    return compiled and hw.compiled_block_efficiency > 0


def block_flops_time_s(costs: LayerCosts, hw: Hardware, *, forwards: int, backward: bool,
                       compiled: bool = False) -> float:
    """GPU time of one micro-batch's `forwards` forwards and (if asked) one backward of a block [s]:

    t = (flops - attention flops) / rate + attention flops / attention_flops_per_s, where rate is
    matmul_flops_per_s times block_efficiency (or compiled_block_efficiency for a compiled block,
    when measured); attention_flops_per_s 0 (not measured) runs attention at that rate too.
    """
    flops = forwards * costs.flops_fwd + (costs.flops_bwd if backward else 0.0)
    attention = forwards * costs.attention_flops_fwd + (costs.attention_flops_bwd if backward else 0.0)
    rate = hw.matmul_flops_per_s * hw.compiled_block_efficiency if _compiled(hw, compiled) else compute_flops_per_s(hw)
    if hw.attention_flops_per_s <= 0:
        return flops / rate
    return (flops - attention) / rate + attention / hw.attention_flops_per_s


def block_forward_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int, *, compiled: bool = False) -> float:
    """Forward of one block for every micro-batch, issued from Python [s]:

    t = m * max(block_flops_time_s, host_block_fwd_s): each micro-batch's kernels run no faster than
    the host thread issues them (host_block_fwd_s, measured; 0 ignores the host). Compiled (and
    measured: compiled_block_efficiency > 0): the compiled calls' own floor, host_compiled_fwd_s (a
    small block's kernels finish before the host has issued the next ones).
    """
    gpu_s = block_flops_time_s(costs, hw, forwards=1, backward=False, compiled=compiled)
    host = hw.host_compiled_fwd_s if _compiled(hw, compiled) else hw.host_block_fwd_s
    return micro_batches * max(gpu_s, host)


def block_backward_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int, *, recompute: bool,
                          compiled: bool = False) -> float:
    """Backward of one block for every micro-batch (recomputing its forward first if asked) [s]:

    t = m * max(block_flops_time_s, host_block_bwd_s + [recompute] host_block_fwd_s); compiled, with
    host_compiled_bwd_s + [recompute] host_compiled_fwd_s.
    """
    gpu_s = block_flops_time_s(costs, hw, forwards=int(recompute), backward=True, compiled=compiled)
    if _compiled(hw, compiled):
        host = hw.host_compiled_bwd_s + (hw.host_compiled_fwd_s if recompute else 0.0)
    else:
        host = hw.host_block_bwd_s + (hw.host_block_fwd_s if recompute else 0.0)
    return micro_batches * max(gpu_s, host)


def block_host_and_device_s(costs: LayerCosts, hw: Hardware, *, compiled: bool = False) -> tuple[float, float]:
    """One micro-batch's forward and backward (without recompute) of a block: (the host's time to issue
    them, 0 where not measured; the device's) [s]. The host's longer: the block is host-bound."""
    device_s = block_flops_time_s(costs, hw, forwards=1, backward=True, compiled=compiled)
    if _compiled(hw, compiled):
        return hw.host_compiled_fwd_s + hw.host_compiled_bwd_s, device_s
    return hw.host_block_fwd_s + hw.host_block_bwd_s, device_s


def head_flops_per_s(hw: Hardware) -> float:
    """Rate the head and loss reach: matmul_flops_per_s * head_efficiency (block_efficiency if 0)."""
    return hw.matmul_flops_per_s * (hw.head_efficiency or hw.block_efficiency)


def epilogue_time_s(costs: LayerCosts, hw: Hardware, micro_batches: int) -> float:
    """Head + loss, forward and backward, for every micro-batch: t = m * (flops_fwd + flops_bwd) /
    head rate  [s] (the fused linear + cross-entropy and the final norm)."""
    return micro_batches * (costs.flops_fwd + costs.flops_bwd) / head_flops_per_s(hw)


def head_recompute_time_s(tokens: int, hidden_size: int, vocab_size: int, hw: Hardware, micro_batches: int) -> float:
    """The logits computed a second time when the head streams by vocabulary chunk (its backward
    cannot keep the forward's chunks): t = m * 2 * tokens * hidden * vocab / head rate  [s]."""
    return micro_batches * 2.0 * tokens * hidden_size * vocab_size / head_flops_per_s(hw)


def offload_time_s(saved_bytes: int, micro_batches: int, bytes_per_s: float,
                   curve: tuple[tuple[int, float], ...]) -> float:
    """Copy a block's saved activations of every micro-batch one way: t = transfer(m * saved)  [s]."""
    return transfer_time_s(micro_batches * saved_bytes, bytes_per_s, curve)


# -- CPU ---------------------------------------------------------------------------------------


# The host's AdamW (bf16 gradient) moves 30 B per parameter of DRAM traffic: fp32 master and moments
# read and written (24), the gradient read (2), the bf16 delivery copy written (2, and 2 read for
# ownership). cpu_adamw_params_per_s is measured writing the copy; a layer whose copy is made on load
# does not write one, and its update is memory-bound like the rest. Its loads read the fp32 master (2 B
# per parameter more) from the same DRAM; charging those bytes to the update as well predicted a measured
# CPU-bound step with every copy made on load 8% too slow (benchmarks/LOG.md), so they are not charged.
HOST_ADAMW_BYTES_PER_PARAM, HOST_ADAMW_COPY_BYTES_PER_PARAM = 30, 4


def cpu_update_time_s(numel: float, hw: Hardware, *, lanes: int = 1, contended: bool = True,
                      copy_written: bool = True) -> float:
    """AdamW of `numel` parameters on one rank's CPU threads [s].

    t = numel / (cpu_adamw_params_per_s * f / lanes) * b: the W ranks split the cores (lanes = W, each
    lane running at the same time); f = cpu_adamw_contended_fraction while DMA runs both ways
    (measured: AdamW loses a third of its rate to the copies' DRAM traffic), else 1; b = 1, or the
    share of its bytes left without the delivery copy (26/30) where no copy is written.
    """
    fraction = hw.cpu_adamw_contended_fraction if contended else 1.0
    share = 1.0 if copy_written else 1 - HOST_ADAMW_COPY_BYTES_PER_PARAM / HOST_ADAMW_BYTES_PER_PARAM
    return numel * lanes / (hw.cpu_adamw_params_per_s * fraction) * share


# AdamW on the device reads and writes the fp32 master and moments (24 B per parameter), reads the
# bf16 gradient (2 B) and writes and reads its fp32 copy times the clip coefficient (8 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 34


def device_update_time_s(numel: float, hw: Hardware) -> float:
    """AdamW of `numel` parameters whose state lives on the device [s]:
    t = numel * DEVICE_ADAMW_BYTES_PER_PARAM / gpu_memory_bytes_per_s (host_dram_bytes_per_s where
    the figure is unknown, as for the CPU "device")."""
    rate = hw.gpu_memory_bytes_per_s or hw.host_dram_bytes_per_s
    return numel * DEVICE_ADAMW_BYTES_PER_PARAM / rate


def streamed_update_bytes(numel: float, elem_bytes: int) -> tuple[float, float]:
    """Bytes (up, down) of an update whose state streams through the device (backend/runtime/streamed_updates.py):
    up the fp32 master and moments and the gradient as the host holds it (the compute dtype), down the
    master, the moments and the delivery copy (bf16 only; fp32 loads read the master)."""
    return numel * (12 + elem_bytes), numel * (12 + (elem_bytes if elem_bytes != 4 else 0))


def cpu_reduce_time_s(numel: float, elem_bytes: int, world_size: int, hw: Hardware, *, lanes: int) -> float:
    """Sum W ranks' gradient copies of `numel` parameters into fp32 on one rank's CPU lane [s].

    bytes = numel * (W * elem_bytes read + 4 written); t = bytes / (host_dram / lanes): the lanes
    reduce at the same time and split host DRAM bandwidth.
    """
    if world_size <= 1:
        return 0.0
    return numel * (world_size * elem_bytes + 4) * lanes / hw.host_dram_bytes_per_s



def host_add_time_s(numel: float, elem_bytes: int, hw: Hardware, *, lanes: int) -> float:
    """Add one landed gradient copy (`elem_bytes` per parameter) into an fp32 host gradient [s]:
    numel * (elem_bytes + 4 read + 4 written) over host DRAM split between `lanes`."""
    return numel * (elem_bytes + 8) * lanes / hw.host_dram_bytes_per_s

# -- collectives -------------------------------------------------------------------------------


def all_gather_time_s(nbytes: float, world_size: int, hw: Hardware, *, hosts: int = 1,
                      link_bytes_per_s: float = 0.0) -> float:
    """All-gather of a layer of `nbytes` (each rank holds nbytes / W) [s].

    Within a host of G = W / hosts ranks, with peer-to-peer: ring, (G - 1) / G * nbytes /
    gpu_p2p_bytes_per_s. Without (gpu_p2p_bytes_per_s == 0), it bounces through the host: each rank
    copies its shard down and the G - 1 others up, nbytes / G / d2h_share + (G - 1) / G * nbytes /
    h2d_share. Across hosts each host receives the (hosts - 1) / hosts of the layer the others own
    over its link; the rings pipeline, so the slower of the two sets the time.
    """
    return max(_within_host_s(nbytes, world_size // hosts, hw, gather=True),
               _between_hosts_s(nbytes, hosts, link_bytes_per_s))


def all_reduce_time_s(nbytes: float, world_size: int, hw: Hardware, *, hosts: int = 1,
                      link_bytes_per_s: float = 0.0) -> float:
    """All-reduce of a gradient of `nbytes` per rank (every rank gets the sum) [s]: a reduce-scatter
    then an all-gather, t = reduce_scatter_time_s + all_gather_time_s."""
    kw = dict(hosts=hosts, link_bytes_per_s=link_bytes_per_s)
    return reduce_scatter_time_s(nbytes, world_size, hw, **kw) + all_gather_time_s(nbytes, world_size, hw, **kw)


def reduce_scatter_time_s(nbytes: float, world_size: int, hw: Hardware, *, hosts: int = 1,
                          link_bytes_per_s: float = 0.0) -> float:
    """Reduce-scatter of a gradient of `nbytes` per rank (each rank keeps nbytes / W summed) [s].

    Within a host of G ranks, with peer-to-peer: ring, (G - 1) / G * nbytes / gpu_p2p_bytes_per_s.
    Without: through the host, each rank copies the (G - 1) / G it does not own down, and its
    summed shard comes back up: (G - 1) / G * nbytes / d2h_share + nbytes / G / h2d_share. Across
    hosts each host sends the (hosts - 1) / hosts that others own over its link; the slower sets it.
    """
    return max(_within_host_s(nbytes, world_size // hosts, hw, gather=False),
               _between_hosts_s(nbytes, hosts, link_bytes_per_s))


def _within_host_s(nbytes: float, ranks: int, hw: Hardware, *, gather: bool) -> float:
    """The part of an all-gather (`gather`) or reduce-scatter among one host's `ranks` GPUs [s]."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    moved = (ranks - 1) / ranks * nbytes
    if hw.gpu_p2p_bytes_per_s > 0:
        return moved / hw.gpu_p2p_bytes_per_s
    down, up = (nbytes / ranks, moved) if gather else (moved, nbytes / ranks)
    return down / d2h_bytes_per_s(hw, ranks, duplex=True) + up / h2d_bytes_per_s(hw, ranks, duplex=True)


def _between_hosts_s(nbytes: float, hosts: int, link_bytes_per_s: float) -> float:
    """A host's share of a collective across `hosts` hosts over its link [s]: (hosts - 1) / hosts * nbytes."""
    if hosts <= 1 or nbytes <= 0:
        return 0.0
    if link_bytes_per_s <= 0:
        raise ValueError(f"a collective across {hosts} hosts needs the link's rate (link_bytes_per_s > 0)")
    return (hosts - 1) / hosts * nbytes / link_bytes_per_s


# -- host DRAM traffic per route -----------------------------------------------------------------


def delivery_dram_bytes(layer_bytes: float, world_size: int, delivery: str) -> float:
    """Host DRAM read to deliver one layer's weights to every rank [bytes].

    replicated: every rank copies the whole layer, W * layer_bytes; sharded: each rank copies its
    1/W and the GPUs all-gather, layer_bytes.
    """
    if delivery == "replicated":
        return world_size * layer_bytes
    if delivery == "sharded":
        return layer_bytes
    raise ValueError(f"unknown delivery route {delivery!r}")


def reduction_dram_bytes(numel: float, elem_bytes: int, world_size: int, reduction: str) -> float:
    """Host DRAM traffic to bring one layer's gradient, summed over ranks, to the optimizer [bytes].

    cpu: W copies land (W * numel * elem written), are read back and summed into fp32
    (W * numel * elem read + numel * 4 written); gpu: reduce-scatter on the GPUs, then each rank
    lands its summed 1/W, numel * elem written in all.
    """
    grad = numel * elem_bytes
    if reduction == "cpu":
        if world_size == 1:
            return grad
        return 2 * world_size * grad + 4 * numel
    if reduction == "gpu":
        return grad
    raise ValueError(f"unknown reduction route {reduction!r}")
