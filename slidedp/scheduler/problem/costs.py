"""Every duration and buffer the scheduler uses, computed once per problem, in integer ticks.

This is the one place where seconds become integers (`TimeScale`): the simulator and the CP-SAT
model both read the tick counts below, so the solver's objective and the simulated step time of
the same decisions are the same integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product

from slidedp.costmodel import memory as mem
from slidedp.costmodel import ops
from slidedp.costmodel.memory import DTYPE_BYTES
from slidedp.scheduler.decisions import (
    CPU, GPU, KEEP, KEPT, OFFLOAD, OFFLOADED, ON_LOAD, RECOMPUTE, RECOMPUTE_OFFLOAD, REPLICATED, RESIDENT, SHARDED,
    STREAMED, Decisions, LayerChoice, Problem, SolverOptions,
)


@dataclass(frozen=True)
class TimeScale:
    """Integer time: one tick is `tick_s` seconds, a power of ten chosen so that the serial sum of
    every operation of a step is between 10^6 and 10^7 ticks (resolution about 10^-6 of a step)."""

    tick_s: float

    @classmethod
    def for_total(cls, total_s: float) -> "TimeScale":
        if total_s <= 0:
            return cls(1e-9)
        return cls(10.0 ** (math.floor(math.log10(total_s)) - 6))

    def ticks(self, seconds: float) -> int:
        return int(round(seconds / self.tick_s))

    def seconds(self, ticks: int) -> float:
        return ticks * self.tick_s


@dataclass(frozen=True)
class TransferOption:
    """One way to move a layer: chunk count and routes, with its per-piece costs in ticks."""

    chunks: int
    delivery: str
    reduction: str
    owned: int  # chunks each rank owns (updates, and copies when sharded) = chunks / W
    load_pieces: int  # pieces a rank copies up per load: chunks (replicated) or owned (sharded)
    fwd_piece: int  # one piece, forward phase, H2D alone
    fwd_piece_duplex: int  # the same while activations are offloaded (both directions busy)
    bwd_piece: int  # one piece, backward phase (gradients going down at the same time)
    grad_pieces: int  # pieces a rank copies down: chunks (cpu reduction) or owned (gpu)
    grad_piece: int
    update_piece: int  # one chunk on one rank's CPU lane: AdamW (+ the sum of W copies, cpu route)
    all_gather: int  # per load, sharded only
    reduce_scatter: int  # per gradient, gpu reduction only
    staging_bytes: int  # device staging of the gradient (costmodel.memory.grad_staging_bytes), and of
    # one fp32 chunk landing to be cast when the delivery copy is made on load
    piece_bytes: int  # bytes of one chunk in the compute dtype
    host_copy: str = KEPT  # the delivery copy kept in host RAM or made on load (decisions.KEPT, ON_LOAD)
    copy_host_bytes: int = 0  # host RAM of the kept copy on the host holding most of it, where it is a
    # decision (copyable_layers); 0 where made on load, or counted in the host state's fixed part
    on_device: bool = False  # the layer's optimizer state on the device (LayerChoice.on_device)
    vocab_streamed: bool = False  # the layer's vocabulary table streams (Problem.vocab_streamed, vocab_choices)

    @property
    def key(self) -> tuple[int, str, str, str, bool, bool]:
        return (self.chunks, self.delivery, self.reduction, self.host_copy, self.on_device, self.vocab_streamed)

    def update_lane_ticks(self) -> int:
        """A rank's CPU lane time for the whole layer: owned * update_piece."""
        return self.owned * self.update_piece

    def load_schedule(self, piece: int, update_piece: int | None = None) -> int:
        """C = max over the pieces i a rank loads of (j_i + 1) * q + (pieces - i) * piece, where piece
        i is the j_i-th chunk its owner updates (j = i // W when every rank loads every chunk, j = i
        when a rank loads only the chunks it owns) and q one chunk's update (`update_piece`, default
        this option's at the step boundary): the earliest end of the load counted from the start of
        the layer's update, if the link were free (see cpsat.py)."""
        q = self.update_piece if update_piece is None else update_piece
        world_size = self.chunks // self.owned
        best = 0
        for i in range(self.load_pieces):
            j = i // world_size if self.delivery == REPLICATED else i
            best = max(best, (j + 1) * q + (self.load_pieces - i) * piece)
        return best


@dataclass(frozen=True)
class BlockTicks:
    fwd: int
    bwd: dict  # activation -> ticks (recompute and recompute_offload add the forward)
    offload: dict  # offloaded activation (decisions.OFFLOADED) -> ticks of its copy of every micro-batch down
    reload: dict  # ... and back up before the backward
    host_bytes: dict  # offloaded activation -> bytes on the host per micro-batch: the saved activations
    # (offload), the block's input (recompute_offload: the boundary activation)
    saved_bytes: int  # per micro-batch
    workspace_bytes: int  # forward's working set
    param_grads_bytes: int  # autograd's parameter gradients during the backward (compute dtype)


@dataclass(frozen=True)
class _Rates:
    """Copy rates (bytes/s per rank) the costs share: H2D alone, H2D and D2H both directions busy, and
    both directions busy while the CPU AdamW runs (Hardware.duplex_contended_fraction)."""

    h2d_alone: float
    h2d_duplex: float
    d2h_duplex: float
    contended: float  # fraction of the duplex rates left beside the CPU's AdamW


class ProblemCosts:
    """Costs of one problem under one set of solver options (immutable once built). Where the tables
    that stream are a decision (Problem.vocab_choices), those of each choice too (`variants`): the
    methods that take decisions answer with the costs of their choice (`variant`)."""

    def __init__(self, problem: Problem, options: SolverOptions | None = None):
        self.problem = problem
        self.options = options or SolverOptions()
        self.cache: dict = {}  # derived structures (memory terms per window), filled on first use
        self._layout()
        self.scale = TimeScale.for_total(self._serial_seconds())
        hw, G = problem.hardware, problem.ranks_per_host  # the ranks sharing one host's links
        rates = _Rates(h2d_alone=ops.h2d_bytes_per_s(hw, G, duplex=False),
                       h2d_duplex=ops.h2d_bytes_per_s(hw, G, duplex=True),
                       d2h_duplex=ops.d2h_bytes_per_s(hw, G, duplex=True),
                       contended=hw.duplex_contended_fraction or 1.0)
        self._choose_routes()
        self.copyable = copyable_layers(problem, self.options)
        # the gradients a plan keeps unless they stream into the update (Problem.grads_streamable), per layer
        self.streamable_grads = {layer.id: mem.host_grad_bytes(layer.numel, DTYPE_BYTES[problem.graph.compute_dtype])
                                 for layer in streamable_grad_layers(problem)}
        self.host_fixed = host_fixed_parts(problem, self.options)
        self._transfer_options(rates)
        self._block_ticks(rates)
        self._device_updates()
        self._streamed_updates(rates)
        self._resident_ticks()
        self._memory_terms()
        self._vocab_variants()

    def _vocab_variants(self) -> None:
        """Where the CP-SAT model chooses which tables stream (Problem.vocab_choices): the costs of each
        choice (`variants`, each the problem with that set fixed: what the simulator prices), and, in
        this one (the resident problem), each streamable layer's options with its table streamed as
        well (TransferOption.vocab_streamed), the streamed epilogue's ticks (`epilogue_streamed`, the
        logits recomputed) and the literal groups (`vocab_groups`: one layer each, a tied table's two
        together). The streamed options of a layer are the same in every choice that streams it."""
        p, E = self.problem, self.epilogue_id
        self.variants: dict = {}
        self.vocab_groups: tuple = ()
        self.epilogue_streamed = self.epilogue
        self.head_reload_optional = False
        if not p.vocab_choices:
            return
        tied = p.graph.tied_table is not None
        for choice in p.vocab_choices:
            variant = replace(p, vocab_choices=(), vocab_streamed=choice,
                              device_state_optional=frozenset(p.device_state_optional) - choice,
                              grads_streamable=p.grads_streamable and not (tied and choice))
            self.variants[choice] = ProblemCosts(variant, self.options)
            assert self.variants[choice].scale == self.scale
        groups = [c for c in p.vocab_choices if c and (tied or len(c) == 1)]
        self.vocab_groups = tuple(tuple(sorted(c)) for c in groups)
        options = [list(opts) for opts in self.layer_options]
        for group in groups:
            variant = self.variants[group]
            for i in group:
                layer = p.graph.layers[i]
                for o in variant.layer_options[i]:
                    assert o.vocab_streamed and not o.on_device
                    if i in self.copyable and i not in variant.copyable and o.host_copy == KEPT:
                        o = replace(o, copy_host_bytes=self._copy_host_bytes(layer, o.chunks))
                    options[i].append(o)
        self.layer_options = [tuple(opts) for opts in options]
        self._option_index = {(i, *o.key): o for i, opts in enumerate(self.layer_options) for o in opts}
        for choice, variant in self.variants.items():  # every choice's options are this one's
            for i, opts in enumerate(variant.layer_options):
                for o in opts:
                    mine = self._option_index[(i, *o.key)]
                    assert replace(mine, copy_host_bytes=o.copy_host_bytes) == o, (choice, i, o.key)
        if any(E in c for c in p.vocab_choices):
            self.epilogue_streamed = next(v for c, v in self.variants.items() if E in c).epilogue
            self.head_reload_optional = True

    def vocab_set(self, d: Decisions) -> frozenset:
        """The layers whose table streams under `d` (their LayerChoice.activation `streamed`)."""
        return frozenset(i for i in (0, self.epilogue_id) if d.layers[i].activation == STREAMED)

    def variant(self, d: Decisions) -> "ProblemCosts":
        """The costs of `d`'s choice of streamed tables (`variants`), or these where it is fixed."""
        if not self.variants:
            return self
        choice = self.vocab_set(d)
        if choice not in self.variants:
            raise ValueError(f"the tables of layers {sorted(choice)} cannot stream together (choices "
                             f"{[sorted(c) for c in self.variants]})")
        return self.variants[choice]

    def _layout(self) -> None:
        """Element size, layer counts and ids; checks the graph is prologue, blocks, epilogue."""
        g = self.problem.graph
        self.elem = DTYPE_BYTES[g.compute_dtype]
        self.n_layers = len(g.layers)
        self.n_blocks = self.n_layers - 2
        self.first_block, self.last_block = 1, self.n_layers - 2
        self.epilogue_id = self.n_layers - 1
        if any(layer.kind != "block" for layer in g.layers[1:-1]) or self.n_blocks < 1:
            raise ValueError("the layer graph must be prologue, one or more blocks, epilogue")

    def _choose_routes(self) -> None:
        """The (delivery, reduction) routes the options and the hardware allow, and the baselines' one."""
        hw, W = self.problem.hardware, self.problem.world_size
        self.routes = [(REPLICATED, CPU)]
        if self.problem.hosts > 1:  # a rank reads only what its own host updates (run/launch.py)
            if (SHARDED, GPU) not in product(self.options.deliveries, self.options.reductions):
                raise ValueError(f"{self.problem.hosts} hosts need sharded delivery and GPU reduction, which the "
                                 f"options leave out (deliveries {self.options.deliveries}, reductions "
                                 f"{self.options.reductions})")
            self.routes = [(SHARDED, GPU)]
        elif W > 1 and (hw.gpu_p2p_bytes_per_s > 0 or self.options.forces_route):
            # without peer-to-peer only where the options force it: the collectives then go through host
            # memory (costmodel.ops); the GPU reduction lets the gradients stream into the update
            self.routes = [(d, r) for d, r in product(self.options.deliveries, self.options.reductions)]
        elif self.options.forces_route:
            raise ValueError(
                f"deliveries {self.options.deliveries} and reductions {self.options.reductions} leave out the "
                "replicated delivery or the CPU reduction, but world_size is 1: only (replicated, cpu) can be planned")
        # the baselines' route: (replicated, cpu) unless the options force another
        self.default_route = (REPLICATED, CPU) if (REPLICATED, CPU) in self.routes else self.routes[0]

    def _transfer_options(self, rates: "_Rates") -> None:
        """Per layer, per chunk count, route, delivery copy and placement of its optimizer state: the
        copies' and updates' ticks (`TransferOption`). A layer whose state may live on the device
        (Problem.device_state_optional) has both placements, one fixed there (Problem.device_state)
        only the device's."""
        problem, t = self.problem, self.scale.ticks
        g, hw, W, G = problem.graph, problem.hardware, problem.world_size, problem.ranks_per_host
        across = dict(hosts=problem.hosts, link_bytes_per_s=problem.link_bytes_per_s)
        curve = hw.transfer_efficiency
        self.layer_options: list[tuple[TransferOption, ...]] = []
        tied = g.tied_table.numel if problem.tied_streamed else 0  # its two uses' gradients go down
        for layer in g.layers:
            numel, opts = layer.numel, []
            moved = self.moved_numel(layer.id)
            placements = (True,) if layer.id in problem.device_state else (
                (False, True) if layer.id in problem.device_state_optional else (False,))
            copies = self.options.host_copies if layer.id in self.copyable else (KEPT,)
            choices = [(mult, route, copy, on_device)
                       for mult, route, copy, on_device in product(self.options.chunk_multiples, self.routes, copies,
                                                                   placements)
                       if not on_device or copy == KEPT]  # copies within the device, update there
            for mult, (delivery, reduction), copy, on_device in choices:
                k = mult * W
                piece_bytes = moved * self.elem / k
                load_bytes = self.load_bytes(layer.id, copy) / k
                owned = k // W
                load_pieces = k if delivery == REPLICATED else owned
                grad_pieces = k if reduction == CPU else owned
                # a host's cores, its ranks' lanes; made on load, the update writes no bf16 copy
                update = ops.cpu_update_time_s(numel / k, hw, lanes=G, copy_written=copy == KEPT)
                if reduction == CPU:  # the prologue sums a streamed tied table's copies of both uses
                    summed = numel + (tied if layer.id == g.prologue.id else 0)
                    update += ops.cpu_reduce_time_s(summed / k, self.elem, W, hw, lanes=G)
                if layer.id == g.prologue.id and (reduction != CPU or W == 1):
                    # else the embedding's part of a streamed tied table's gradient is added on the host
                    update += ops.host_add_time_s(tied / k, self.elem, hw, lanes=G)
                option = TransferOption(
                    chunks=k, delivery=delivery, reduction=reduction, owned=owned, load_pieces=load_pieces,
                    fwd_piece=t(ops.transfer_time_s(load_bytes, rates.h2d_alone, curve)),
                    fwd_piece_duplex=t(ops.transfer_time_s(load_bytes, rates.h2d_duplex, curve)),
                    bwd_piece=t(ops.transfer_time_s(load_bytes, rates.h2d_duplex, curve)),
                    grad_pieces=grad_pieces,
                    grad_piece=t(ops.transfer_time_s(piece_bytes, rates.d2h_duplex, curve)),
                    update_piece=t(update),
                    all_gather=(t(ops.all_gather_time_s(moved * self.elem, W, hw, **across))
                                if delivery == SHARDED else 0),
                    reduce_scatter=(t(ops.reduce_scatter_time_s(moved * self.elem, W, hw, **across))
                                    if reduction == GPU else 0),
                    staging_bytes=mem.grad_staging_bytes(numel, self.elem, k, W, reduction),
                    piece_bytes=int(math.ceil(piece_bytes)),
                    host_copy=copy,
                    copy_host_bytes=self._copy_host_bytes(layer, k) if copy == KEPT and not on_device else 0,
                    on_device=on_device,
                    vocab_streamed=layer.id in problem.vocab_streamed,
                )
                if layer.id in problem.vocab_streamed:  # its chunks' casts: costmodel.memory.vocab_stream_bytes
                    option = replace(option, staging_bytes=0)
                if copy == ON_LOAD:  # one chunk (a vocabulary chunk where the table streams) lands in fp32
                    landing = min(-(-numel // k), problem.vocab_chunk_numel if layer.id in problem.vocab_streamed
                                  else numel)
                    option = replace(option, staging_bytes=option.staging_bytes + 4 * landing)
                if on_device and problem.device_state_sharded:
                    # each load: the owners cast their master's chunks into the slot and the GPUs
                    # all-gather them (chunk by chunk, on the H2D stream); the fp32 gradient is
                    # reduce-scattered onto the owners on the D2H stream
                    gather = ops.all_gather_time_s(numel * self.elem, W, hw, **across) / load_pieces
                    scatter = ops.reduce_scatter_time_s(numel * 4, W, hw, **across) / grad_pieces
                    option = replace(option, fwd_piece=t(gather), fwd_piece_duplex=t(gather), bwd_piece=t(gather),
                                     grad_piece=t(scatter), update_piece=0, all_gather=0, reduce_scatter=0,
                                     staging_bytes=0)
                elif on_device:  # the fp32 gradient all-reduced between the devices, on the D2H stream
                    all_reduce = ops.all_reduce_time_s(numel * 4, W, hw, **across) / grad_pieces
                    option = replace(option, fwd_piece=0, fwd_piece_duplex=0, bwd_piece=0, grad_piece=t(all_reduce),
                                     update_piece=0, all_gather=0, reduce_scatter=0, staging_bytes=0)
                opts.append(option)
            self.layer_options.append(tuple(opts))
        self._option_index = {(i, *o.key): o for i, opts in enumerate(self.layer_options) for o in opts}

    def moved_numel(self, layer_id: int) -> int:
        """Parameters a layer's copies move (each load, its gradient): its own, and for the epilogue a
        streamed tied table's (stored by the prologue; loaded for the head's forward and again for its
        backward, the head's gradient sent down, the embedding's added to it on the host)."""
        g = self.problem.graph
        tied = layer_id == g.epilogue.id and self.problem.tied_streamed
        return g.layers[layer_id].numel + (g.tied_table.numel if tied else 0)

    def load_bytes(self, layer_id: int, host_copy: str) -> float:
        """Bytes of one load of a layer: the compute dtype, or made on load (decisions.ON_LOAD) the fp32
        master (4 B per parameter) of its own parameters; a streamed tied table's from the prologue's
        kept copy (copyable_layers)."""
        numel, moved = self.problem.graph.layers[layer_id].numel, self.moved_numel(layer_id)
        return numel * 4 + (moved - numel) * self.elem if host_copy == ON_LOAD else moved * self.elem

    def _copy_host_bytes(self, layer, chunks: int) -> int:
        """Host RAM of a copyable layer's kept delivery copy on the host holding most of it: the whole
        layer on one host; with several, at most ceil(chunks / hosts) of its chunks (a bound)."""
        if layer.id not in self.copyable:
            return 0
        hosts, n = self.problem.hosts, layer.numel
        held = n if hosts == 1 else min(n, -(-chunks // hosts) * -(-n // chunks))
        return mem.host_copy_bytes(held, self.elem)

    def _block_ticks(self, rates: "_Rates") -> None:
        """Per block: forward, backward per activation policy, offload and reload ticks, and its bytes."""
        problem, t = self.problem, self.scale.ticks
        g, hw, m = problem.graph, problem.hardware, problem.micro_batches
        curve = hw.transfer_efficiency
        self.blocks: dict[int, BlockTicks] = {}
        self.boundary_bytes = max([layer.costs.boundary_activation_bytes for layer in g.layers])
        for layer in g.blocks:
            c = layer.costs
            host = {OFFLOAD: c.saved_activation_bytes, RECOMPUTE_OFFLOAD: self.boundary_bytes}
            bwd_recompute = t(ops.block_backward_time_s(c, hw, m, recompute=True, compiled=problem.compiled_blocks))
            bwd_plain = t(ops.block_backward_time_s(c, hw, m, recompute=False, compiled=problem.compiled_blocks))
            # compiled: every policy's forward and backward at the compiled rate (executor.py)
            compiled = problem.compiled_blocks
            self.blocks[layer.id] = BlockTicks(
                fwd=t(ops.block_forward_time_s(c, hw, m, compiled=compiled)),
                bwd={RECOMPUTE: bwd_recompute, KEEP: bwd_plain, OFFLOAD: bwd_plain, RECOMPUTE_OFFLOAD: bwd_recompute},
                offload={a: t(ops.offload_time_s(n, m, rates.d2h_duplex, curve)) for a, n in host.items()},
                reload={a: t(ops.offload_time_s(n, m, rates.h2d_duplex, curve)) for a, n in host.items()},
                host_bytes=host,
                saved_bytes=c.saved_activation_bytes,
                workspace_bytes=c.peak_workspace_bytes,
                param_grads_bytes=mem.param_grads_bytes(layer.numel, self.elem),
            )

    def _device_updates(self) -> None:
        """Per layer whose state is or may be on the device: its state's bytes per rank and its
        device AdamW's ticks; and the forward before each layer (for the delay of `device_update`)."""
        problem, t = self.problem, self.scale.ticks
        g, hw, m = problem.graph, problem.hardware, problem.micro_batches
        # Sharded (several ranks): each rank keeps and updates only its chunks, the busiest rank's
        # share at the largest chunk size any option of the layer has (about numel / W).
        capable = [layer for layer in g.layers if layer.id in problem.device_capable]
        numel = {layer.id: self.device_state_shard_numel(layer) for layer in capable}
        self.device_state_layer_bytes = {i: mem.device_state_bytes(n, self.elem) for i, n in numel.items()}
        # the update's fp32 piece: the largest a device-state layer may need (a small layer's whole share)
        self.device_update_piece_bytes = mem.device_update_piece_bytes(numel.values())
        self.device_update_ticks = {i: t(ops.device_update_time_s(n, hw)) for i, n in numel.items()}
        self.prologue_fwd = t(ops.forward_time_s(g.prologue.costs, hw, m))  # without the devices' updates
        self.forward_before, elapsed = {g.prologue.id: 0}, self.prologue_fwd
        for b in g.blocks:
            self.forward_before[b.id], elapsed = elapsed, elapsed + self.blocks[b.id].fwd
        self.forward_before[g.epilogue.id] = elapsed

    def device_update(self, on_device) -> int:
        """Ticks by which the device's AdamW of the layers `on_device` delays the forward's start.

        It runs at the step boundary on a stream of its own, in forward order, beside the next forward
        (backend/runtime/rank.py); the forward reaches each such layer after the forward of the layers
        before it, and is delayed (at its start) by the most any update, with those before it, runs
        past that: max(0, max_k (sum_{j<=k} U_j - F_<k)) over the layers k on the device."""
        updated, delay = 0, 0
        for i in sorted(on_device):
            updated += self.device_update_ticks[i]
            delay = max(delay, updated - self.forward_before[i])
        return delay

    def prologue_fwd_ticks(self, d: Decisions) -> int:
        """The prologue's forward under `d`, delayed by its device state's updates (`device_update`)."""
        return self.prologue_fwd + self.device_update(d.device_state)

    def device_state_bytes(self, on_device) -> int:
        """Device bytes per rank of the optimizer state of the layers `on_device`, and of their update's
        fp32 piece where there is any (`device_update_piece_bytes`)."""
        on_device = list(on_device)
        return sum(self.device_state_layer_bytes[i] for i in on_device) + (
            self.device_update_piece_bytes if on_device else 0)

    def device_state_shard_numel(self, layer) -> int:
        """Parameters of a device-state layer the busiest rank keeps: all of them unless sharded."""
        W = self.problem.world_size
        if not self.problem.device_state_sharded:
            return layer.numel
        return max(mem.device_state_shard_numel(layer.numel, m * W, W) for m in self.options.chunk_multiples)

    def _streamed_updates(self, rates: "_Rates") -> None:
        """Per host layer and chunk count, each chunk's streamed-update pieces as (up, down) ticks."""
        problem, t = self.problem, self.scale.ticks
        g, hw = problem.graph, problem.hardware
        curve = hw.transfer_efficiency
        # Streamed updates (decisions.streamed): per host layer and chunk count, per chunk (the owner's
        # part, backend.lowering.program.chunk_bounds) its pieces' (up, down) ticks; up: H2D, down: the device's
        # AdamW of the piece, then D2H (both directions busy: duplex rates, the W ranks sharing links; at
        # the step boundary, beside the CPU's round of updates: the rates left under its AdamW).
        self.streamed_pieces: dict[tuple[int, int], tuple[tuple[tuple[int, int], ...], ...]] = {}
        self.streamed_update_bytes = mem.streamed_update_bytes(self.elem)
        for layer in g.layers:
            if layer.id in problem.device_state or not layer.numel:
                continue
            for k in sorted({o.chunks for o in self.layer_options[layer.id]}):
                size = -(-layer.numel // k)
                chunks = []
                for lo in range(0, layer.numel, size):
                    pieces = []
                    for a in range(lo, min(lo + size, layer.numel), mem.STREAMED_PIECE_NUMEL):
                        n = min(mem.STREAMED_PIECE_NUMEL, lo + size - a, layer.numel - a)
                        up, down = ops.streamed_update_bytes(n, self.elem)
                        pieces.append((t(ops.transfer_time_s(up, rates.h2d_duplex * rates.contended, curve)),
                                       t(ops.device_update_time_s(n, hw)
                                         + ops.transfer_time_s(down, rates.d2h_duplex * rates.contended, curve))))
                    chunks.append(tuple(pieces))
                self.streamed_pieces[(layer.id, k)] = tuple(chunks)
        self.streamed_layers = frozenset(i for i, _ in self.streamed_pieces)

    def _resident_ticks(self) -> None:
        """The prologue's backward and the epilogue (head and loss), in ticks."""
        t = self.scale.ticks
        g, hw, m = self.problem.graph, self.problem.hardware, self.problem.micro_batches
        self.prologue_bwd = t(ops.backward_time_s(g.prologue.costs, hw, m, recompute=False))
        epilogue = ops.epilogue_time_s(g.epilogue.costs, hw, m)
        # A streamed head is loaded a second time for the backward (lanes.py `load[LE,head]`), which
        # recomputes the logits chunk by chunk.
        self.head_reload = self.epilogue_id in self.problem.vocab_streamed
        if self.head_reload:
            epilogue += ops.head_recompute_time_s(g.batch_size * g.seq_len, g.hidden_size, g.vocab_size, hw, m)
        self.epilogue = t(epilogue)

    def _memory_terms(self) -> None:
        """Memory constants (bytes per rank): resident layers, accumulators, boundary and epilogue."""
        problem, g = self.problem, self.problem.graph
        # A streamed layer keeps only its parameters other than the vocabulary table resident.
        self.resident_params_bytes, self.resident_grads_bytes = mem.resident_layer_bytes(
            g.edge_resident_numel(problem.vocab_streamed), self.elem)
        rows = problem.vocab_chunk_rows
        self.vocab_stream_bytes = {i: mem.vocab_stream_bytes(rows, g.hidden_size, self.elem)
                                   for i in problem.vocab_streamed}
        self.max_block_numel = max(layer.numel for layer in g.blocks)
        self.grad_accumulators_bytes = mem.grad_accumulators_bytes(self.max_block_numel)
        tokens = g.batch_size * g.seq_len
        table = g.prologue.vocab_param(g.vocab_size) if g.prologue.id in problem.vocab_streamed else None
        self.prologue_working_bytes = mem.prologue_backward_bytes(
            g.prologue.params, problem.micro_batches, tokens, table.name if table is not None else None,
            min(rows, g.vocab_size))
        if self.head_reload:
            self.epilogue_working_bytes = mem.streamed_epilogue_working_bytes(
                tokens, g.hidden_size, min(rows, g.vocab_size), self.elem, problem.effective_loss_chunk_tokens,
                problem.micro_batches)
        else:
            self.epilogue_working_bytes = mem.epilogue_working_bytes(
                tokens, g.hidden_size, g.vocab_size, self.elem, problem.effective_loss_chunk_tokens,
                fused=g.linear_head)

    def edge_activation(self, layer_id: int) -> str:
        """The placement of the prologue's or epilogue's table: `streamed` or `resident`."""
        return STREAMED if layer_id in self.problem.vocab_streamed else RESIDENT

    # -- helpers -------------------------------------------------------------------------------
    def host_offload_bytes(self, d: Decisions) -> int:
        """Host memory the offloaded activations of `d` take: sum over offloading blocks of m * host_bytes
        (the saved activations of offload, the block's input of recompute_offload)."""
        m = self.problem.micro_batches
        return sum(m * b.host_bytes[d.layers[i].activation] for i, b in self.blocks.items()
                   if d.layers[i].activation in OFFLOADED)

    def host_memory(self, d: Decisions) -> dict[str, int]:
        """Host RAM of `d` by category, of one host's ranks (costmodel.memory.host_memory): the host
        state as laid out for this problem (with several hosts, that of the host holding the most:
        each holds the chunks its ranks own, backend/state/host_state.py host_runs), the spare state
        of d's early updates, its offloaded activations and the pinned staging of its largest chunk."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).host_memory(d)
        g, G, p = self.problem.graph, self.problem.ranks_per_host, self.problem
        on_device = d.device_state
        max_chunk = max((-(-layer.numel // c.chunks) for layer, c in zip(g.layers, d.layers)
                         if layer.id not in on_device), default=0)
        no_grad = [i for i in self.streamable_grads if i not in on_device] if d.grads_streamed else ()

        def of_host(numels) -> dict[str, int]:
            return mem.host_memory(numels, self.elem, world_size=G, lean=host_lean_layers(p, on_device),
                                   spare=self.spare_layers(d),
                                   no_copy=self.copies_made_on_load(d),
                                   no_grad=no_grad, offloaded_bytes=G * self.host_offload_bytes(d),
                                   max_chunk_numel=max_chunk)

        return max((of_host(numels) for numels in self.host_numels(d)), key=lambda parts: parts["state"])

    def host_numels(self, d: Decisions) -> list[list[int]]:
        """Per host, the parameters of each layer it holds under `d` (chunk k of the layer at update
        position q owned by rank `owner(q, k)`, as the plan records it): one list for one host."""
        p, g = self.problem, self.problem.graph
        position = {layer: q for q, layer in enumerate(d.order(self.n_layers))}
        layers = [(layer.numel, c.chunks, tuple(self.owner(position[layer.id], k) for k in range(c.chunks)))
                  for layer, c in zip(g.layers, d.layers)]
        return [mem.host_held_numels(layers, p.world_size, p.hosts, h, whole=d.device_state)
                for h in range(p.hosts)]

    def copies_made_on_load(self, d: Decisions) -> frozenset:
        """The layers of `d` whose delivery copy is made on load."""
        return frozenset(i for i, c in enumerate(d.layers) if c.host_copy == ON_LOAD)

    def kept_copy_bytes(self, d: Decisions) -> int:
        """Host RAM of the delivery copies `d` keeps where that is a decision (`copy_host_bytes`)."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).kept_copy_bytes(d)
        return sum(self.option_of(i, c).copy_host_bytes for i, c in enumerate(d.layers))

    def streamable_grad_bytes(self, d: Decisions) -> int:
        """Host RAM of the gradients of `d`'s host layers that could stream into their update."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).streamable_grad_bytes(d)
        on_device = d.device_state
        return sum(b for i, b in self.streamable_grads.items() if i not in on_device)

    def host_left_bytes(self, d: Decisions, grads: bool = True) -> int:
        """Host RAM of one host that `d` takes beyond the fixed part (`host_fixed`): its ranks' offloaded
        activations, the delivery copies it keeps and, where they could stream, the gradients it keeps
        (`grads` False: none, as the CP-SAT model counts them)."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).host_left_bytes(d, grads)
        kept = self.streamable_grad_bytes(d) if grads and not d.grads_streamed else 0
        return self.problem.ranks_per_host * self.host_offload_bytes(d) + self.kept_copy_bytes(d) + kept

    def host_room(self, d: Decisions) -> int | None:
        """Host RAM of one host that `d`'s `host_left_bytes` may take (None: unbounded): the ranks'
        `host_offload_bytes`, and what the host budget leaves beside the fixed part of d's placement."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).host_room(d)
        p = self.problem
        rooms = [p.ranks_per_host * p.host_offload_bytes] if p.host_offload_bytes is not None else []
        if p.host_budget_bytes is not None:
            rooms.append(p.host_budget_bytes - self.host_fixed.bytes(d.device_state))
        return min(rooms, default=None)

    def early_host_bytes(self, d: Decisions) -> int | None:
        """Host RAM early updates' spare state may take with `d`'s `host_left_bytes` (None: no early
        updates): Problem.early_host_bytes, within what the host budget leaves beside the fixed part."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).early_host_bytes(d)
        p = self.problem
        if p.early_host_bytes is None or p.host_budget_bytes is None:
            return p.early_host_bytes
        return min(p.early_host_bytes, p.host_budget_bytes - self.host_fixed.bytes(d.device_state))

    def spare_layers(self, d: Decisions) -> tuple[int, ...]:
        """Layers with a spare fp32 master and moments, which d's early updates write out of place: its
        early order; none where the gradients stream into the update or the early updates are in place
        (as Plan.spare_layers)."""
        return () if d.grads_streamed or self.problem.early_in_place else tuple(d.early_order)

    def spare_bytes(self, d: Decisions) -> int:
        """Host bytes of d's spare state (spare_layers), page-aligned as the host state lays them out
        (costmodel.memory.host_spare_bytes)."""
        numel = {layer.id: layer.numel for layer in self.problem.graph.layers}
        return sum(mem.host_spare_bytes(numel[i]) for i in self.spare_layers(d))

    def fits(self, d: Decisions, peak_bytes: int, budget_bytes: int, grads: bool = True) -> bool:
        """The device peak within the budget; the fixed host part of d's placement, the offloaded
        activations, the kept delivery copies and (`grads`) gradients within host memory (`host_room`),
        and with them the spare state of d's early updates within what those may take (`early_host_bytes`)."""
        if self.variants:  # the costs of d's streamed tables
            return self.variant(d).fits(d, peak_bytes, budget_bytes, grads)
        room, left = self.host_room(d), self.host_left_bytes(d, grads)
        if peak_bytes > budget_bytes or (room is not None and left > room):
            return False
        spare = self.spare_bytes(d)
        limit = self.early_host_bytes(d) if spare else None
        return not spare or (limit is not None and spare + left <= limit)

    def windows(self) -> tuple[int, ...]:
        """Window sizes worth trying: the options, capped at the number of blocks."""
        return tuple(sorted({min(w, self.n_blocks) for w in self.options.windows}))

    def option_of(self, layer_id: int, c: LayerChoice) -> TransferOption:
        """The transfer option of a layer's choice (its chunks, routes, delivery copy, placement and,
        for the prologue and epilogue, whether its table streams)."""
        try:
            return self._option_index[(layer_id, c.chunks, c.delivery, c.reduction, c.host_copy, c.on_device,
                                       c.activation == STREAMED)]
        except KeyError:
            raise ValueError(f"layer {layer_id}: no option chunks={c.chunks}, {c.delivery}, {c.reduction}, copy "
                             f"{c.host_copy}, state on the {'device' if c.on_device else 'host'} among "
                             f"{[o.key for o in self.layer_options[layer_id]]}") from None

    def may_stream_gradients(self, d: Decisions) -> bool:
        """Whether `d`'s gradients may stream into the update (Problem.grads_streamable): no streamed
        updates and, with several ranks, every host layer reduced on the GPUs (the CPU reduction sums the
        ranks' gradients into a host gradient)."""
        p = self.problem
        return (p.grads_streamable and not d.streamed
                and (p.world_size == 1 or all(c.reduction == GPU for c in d.layers if not c.on_device)))

    def early_piece(self, o: TransferOption) -> int:
        """One chunk's update on a rank's CPU lane beside the backward (note [early updates] in
        oracles/timeline.py): `o.update_piece` at hardware.cpu_adamw_backward_fraction of the CPU's
        AdamW rate instead of cpu_adamw_contended_fraction (ticks), the rate of an update written out
        of place beside those copies; in place (Problem.early_in_place, streamed gradients included)
        the boundary's rate, `o.update_piece`."""
        hw = self.problem.hardware
        if self.problem.early_in_place:  # written over its inputs, as the boundary's updates
            return o.update_piece
        slower = hw.cpu_adamw_contended_fraction / (hw.cpu_adamw_backward_fraction or hw.cpu_adamw_contended_fraction)
        return math.ceil(o.update_piece * slower)

    def owner(self, update_position: int, chunk: int) -> int:
        """Rank whose CPU threads update a chunk: (position in update order + chunk) mod W."""
        return (update_position + chunk) % self.problem.world_size

    def weight_slots_bytes(self, window: int) -> int:
        return mem.weight_slots_bytes(self.max_block_numel, self.elem, window)

    def _serial_seconds(self) -> float:
        """Every operation of a recompute-all step, one after another (for the time scale only)."""
        g, hw, m = self.problem.graph, self.problem.hardware, self.problem.micro_batches
        total = 0.0
        for layer in g.layers:
            total += ops.forward_time_s(layer.costs, hw, m) * 2 + ops.backward_time_s(
                layer.costs, hw, m, recompute=False)
            nbytes = layer.numel * self.elem
            total += 2 * nbytes / hw.h2d_bytes_per_s + nbytes / hw.d2h_bytes_per_s
            total += ops.cpu_update_time_s(layer.numel, hw)
        return total


def copyable_layers(problem: Problem, options: SolverOptions) -> frozenset:
    """Layers whose delivery copy is a decision (kept or made on load) while their state is on the host:
    with a compute dtype narrower than fp32, where the problem offers it (Problem.copies_on_load) and the
    options allow it; not the layers whose state is fixed on the device (their loads read the device's
    master), nor the prologue of a streamed tied table (the epilogue's loads of it are priced from a kept
    copy)."""
    g = problem.graph
    if not problem.copies_on_load or ON_LOAD not in options.host_copies or DTYPE_BYTES[g.compute_dtype] == 4:
        return frozenset()
    tied = {g.prologue.id} if problem.tied_streamed else set()
    return frozenset(layer.id for layer in g.layers
                     if layer.id not in problem.device_state and layer.id not in tied and layer.numel)


def streamable_grad_layers(problem: Problem) -> list:
    """The layers whose gradient may stream into their update while their state is on the host
    (Problem.grads_streamable): every layer with parameters whose state is not fixed on the device."""
    if not problem.grads_streamable:
        return []
    return [layer for layer in problem.graph.layers if layer.numel and layer.id not in problem.device_state]


def host_lean_layers(problem: Problem, on_device) -> frozenset:
    """Layers whose host state is lean (nothing on the host: costmodel.memory.host_layer_bytes):
    those whose optimizer state is on the device (`on_device`) of a one-rank engine, which runs in the
    engine's own process (with several ranks every layer keeps its full host state)."""
    return frozenset(on_device) if problem.world_size == 1 else frozenset()


@dataclass(frozen=True)
class HostFixed:
    """The host RAM every plan of a problem takes whatever its decisions but the placement of the
    optimizer state (one host's ranks), as a function of the layers `on_device` whose state is on the
    device: the host state with its control region, the pinned gradient staging of the largest chunk
    of a host layer, and the lean layers' load staging. Linear but for the largest chunk, as the
    CP-SAT model writes it:

        control + sum_L (device_L if L on the device else host_L)
              + staging_per_numel * max_{L on the host} chunk_numel_L + load_staging [some L on the device]
    """

    control: int  # the control region
    host: tuple[int, ...]  # per layer: its host state with its state on the host
    device: tuple[int, ...]  # ... on the device (nothing with one rank: lean)
    chunk_numel: tuple[int, ...]  # per layer: its largest chunk, staged on the host while its state is there
    staging_per_numel: int  # pinned staging bytes per parameter of the largest chunk
    load_staging: int  # the lean layers' staging when there is one (one rank), else 0

    def memory(self, on_device) -> dict[str, int]:
        """By category, as costmodel.memory.host_memory names them."""
        on_device = frozenset(on_device)
        state = self.control + sum(self.device[i] if i in on_device else self.host[i] for i in range(len(self.host)))
        chunk = max((n for i, n in enumerate(self.chunk_numel) if i not in on_device), default=0)
        return {"state": state, "spare": 0, "offloaded_activations": 0,
                "pinned_buffers": self.staging_per_numel * chunk,
                "load_staging": self.load_staging if on_device else 0}

    def bytes(self, on_device) -> int:
        return sum(self.memory(on_device).values())


def host_fixed_parts(problem: Problem, options: SolverOptions) -> HostFixed:
    """The `HostFixed` of a problem (costmodel.memory counts each part): the host state without the
    delivery copies that are decisions (copyable_layers) nor the gradients that may stream into the
    update (streamable_grad_layers) (with several hosts, a bound on a host's share over every chunk
    count; a layer whose state is on the device whole on every host), and the pinned gradient
    staging of the largest chunk any decisions can have (the fewest chunks: the smallest chunk
    multiple times the ranks). Early updates' spare state, offloaded activations, kept copies and
    gradients come on top, as the decisions choose them."""
    g, W, G = problem.graph, problem.world_size, problem.ranks_per_host
    elem = DTYPE_BYTES[g.compute_dtype]
    fewest = min(options.chunk_multiples) * W
    copyable = copyable_layers(problem, options)
    streamable = {layer.id for layer in streamable_grad_layers(problem)}
    host, device = [], []
    for layer in g.layers:
        n = layer.numel
        if problem.hosts > 1:  # a host holds its ranks' chunks: at most chunks / hosts of them, whatever the count
            n = max(min(n, -(-m * W // problem.hosts) * -(-n // (m * W))) for m in options.chunk_multiples)
        host.append(mem.host_layer_bytes(n, elem, copy=layer.id not in copyable, grad=layer.id not in streamable))
        device.append(mem.host_layer_bytes(layer.numel, elem, lean=W == 1))
    return HostFixed(control=mem.host_state_bytes((), elem, control_ints=mem.step_flag_ints(G, len(g.layers))),
                     host=tuple(host), device=tuple(device),
                     chunk_numel=tuple(-(-layer.numel // fewest) for layer in g.layers),
                     staging_per_numel=mem.host_staging_bytes(1, elem, G),
                     load_staging=mem.load_staging_bytes([0]) if W == 1 else 0)


def host_fixed_memory(problem: Problem, options: SolverOptions, on_device=None) -> dict[str, int]:
    """Host RAM every plan of `problem` takes with the optimizer state of `on_device` on the device
    (None: the layers fixed there), by category (`HostFixed`)."""
    return host_fixed_parts(problem, options).memory(problem.device_state if on_device is None else on_device)


def host_fixed_bytes(problem: Problem, options: SolverOptions, on_device=None) -> int:
    """The sum of host_fixed_memory."""
    return sum(host_fixed_memory(problem, options, on_device).values())
