"""What the scheduler decides, and for what: plain frozen records shared by every strategy.

A `Problem` is the workload to schedule (layer IR, hardware, ranks, micro-batches, loss chunk).
`Decisions` is one complete choice for it: the window, the update order across the step boundary,
and per layer its chunk count, activation policy, routes, delivery copy and the placement of its
optimizer state (host or device). `SolverOptions` lists the values each
decision may take; the CP-SAT model, the baselines and brute force all draw from the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slidedp.costmodel.hardware import Hardware
from slidedp.costmodel.memory import VOCAB_CHUNK_NUMEL, vocab_chunk_rows
from slidedp.ir.graph import BLOCK, LayerGraph
from slidedp.scheduler.plan import BLOCK_ACTIVATIONS, RECOMPUTED_ACTIVATIONS

RECOMPUTE, KEEP, OFFLOAD, RESIDENT = "recompute", "keep", "offload", "resident"
# Recompute, the block's input (its boundary activation) offloaded to host memory after the forward
# and copied back before the backward: the boundary stash leaves the device in between.
RECOMPUTE_OFFLOAD = "recompute_offload"
# A prologue or epilogue whose vocabulary table streams by row ranges instead of staying on the device
# (Problem.vocab_streamed; docs/design.md §4.14).
STREAMED = "streamed"
ACTIVATIONS = BLOCK_ACTIVATIONS  # recompute, keep, offload, recompute_offload (the plan's names)
OFFLOADED = (OFFLOAD, RECOMPUTE_OFFLOAD)  # a copy down after the forward, back up before the backward
RECOMPUTED = RECOMPUTED_ACTIVATIONS  # the backward recomputes the forward
REPLICATED, SHARDED = "replicated", "sharded"
CPU, GPU = "cpu", "gpu"
FORWARD_ORDER, HEAD_FIRST = "forward", "head_first"
# A host layer's delivery copy (the weights in the compute dtype, which H2D copies read): kept in host
# RAM beside the fp32 master (written by each update), or made on load (H2D copies read the master,
# twice the bytes, and the device casts each chunk): 2 B per parameter less host RAM in bf16.
KEPT, ON_LOAD = "kept", "on_load"
# Layer groups that share a delivery and a reduction route.
GROUPS = ("prologue", "blocks", "epilogue")


@dataclass(frozen=True)
class Problem:
    graph: LayerGraph
    hardware: Hardware
    world_size: int = 1
    micro_batches: int = 1
    loss_chunk_tokens: int = 4096  # tokens per chunk of the epilogue's chunked cross-entropy
    compiled_blocks: bool = False  # block compute at the hardware's compiled rate (costmodel.ops)
    host_offload_bytes: int | None = None  # host memory that offloaded activations may take (None: no limit)
    # Layers whose fp32 master weights and AdamW moments live on the device, the same on every rank
    # (loaded once, updated there, never copied over PCIe; their gradient is all-reduced between the
    # devices): `device_state` fixed there, `device_state_optional` where the solver chooses
    # (LayerChoice.on_device, a decision of the CP-SAT model); solve.py sets both from the options.
    device_state: frozenset = frozenset()
    device_state_optional: frozenset = frozenset()
    # Several ranks: each keeps the device state only of the chunks it owns (reduce-scattered
    # gradient, owner's update, weights all-gathered into the slots at each load); False: every
    # rank keeps the same full copy (all-reduced gradient, the same update everywhere).
    device_state_sharded: bool = False
    # Host bytes the spare master and moments of early updates may take together with the offloaded
    # activations of all ranks (backend/runtime/early_updates.py: one rank, no clipping); None: early
    # updates are not allowed.
    early_host_bytes: int | None = None
    # Host layers whose AdamW may run on the device at the step boundary, their state streamed up and
    # back down (backend/runtime/streamed_updates.py: each rank its own chunks; allowed where the device's
    # memory bandwidth is known); the solver picks a prefix of the host layers in update order (streamed.py).
    streamed_updates: bool = False
    # Hosts the ranks span (world_size / hosts ranks each, numbered host by host): each host's ranks
    # share its links, DRAM and CPU cores; between hosts, collectives cross `link_bytes_per_s` (each
    # host's rate into the network), and every host layer is delivered sharded and reduced on the GPUs.
    hosts: int = 1
    link_bytes_per_s: float = 0.0
    # The prologue and/or epilogue (layer ids) whose vocabulary table (LayerGraph.vocab_table) streams
    # through the device in row ranges of at most `vocab_chunk_numel` parameters instead of sitting whole
    # on it with a whole fp32 gradient: the embedding's rows in the forward, the head's twice (forward for
    # the logsumexp, backward recomputing the logits), each chunk's gradient sent down as it is made; a
    # tied table for both layers or neither (LayerGraph.vocab_sets).
    vocab_streamed: frozenset = frozenset()
    # The sets of layers whose table may stream, among which the CP-SAT model chooses (a Boolean per
    # layer, one for a tied table: the edge layers' LayerChoice.activation, `streamed` or `resident`);
    # (): `vocab_streamed` is fixed. With choices, vocab_streamed is empty (the resident problem) and a
    # layer whose state the model may put on the device streams only with its state on the host.
    vocab_choices: tuple = ()
    vocab_chunk_numel: int = VOCAB_CHUNK_NUMEL
    # Host layers may make their delivery copy on load (LayerChoice.host_copy): offered where a host
    # budget could bind (solve.py); the copies kept then count with the offloaded activations (against
    # `host_offload_bytes` and `host_budget_bytes`), the host state's fixed part counting none.
    copies_on_load: bool = False
    # The host layers' gradients may stream into their update (Decisions.grads_streamed): no clipping,
    # one pass, several ranks only with the GPU reduction, and a non-finite gradient stops training
    # instead of skipping the step (CompileOptions.nonfinite "stop"). The host state's fixed part then
    # counts no gradient; one kept counts with the offloaded activations.
    grads_streamable: bool = False
    # A non-finite gradient stops training (nonfinite "stop", no clipping): early updates (one rank)
    # then write over the state they read, with no spare state, at the CPU AdamW's in-place rate.
    early_in_place: bool = False
    # Host RAM one host's ranks may take in all (costs.host_memory: host state, spare state, offloaded
    # activations, pinned buffers); None: unbounded. A constraint of every search, the CP-SAT model's
    # included: with one rank a layer whose state is on the device takes nothing of it.
    host_budget_bytes: int | None = None

    def __post_init__(self):
        for name in ("world_size", "micro_batches", "loss_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or self.hosts < 1 \
                or self.world_size % self.hosts:
            raise ValueError(f"hosts must be a positive int dividing world_size {self.world_size}, got {self.hosts!r}")
        if self.hosts > 1 and not self.link_bytes_per_s > 0:
            raise ValueError(f"{self.hosts} hosts need the link between them: link_bytes_per_s > 0")
        for name in ("device_state", "device_state_optional"):
            if not set(getattr(self, name)) <= {layer.id for layer in self.graph.layers}:
                raise ValueError(f"{name} must be layer ids, got {sorted(getattr(self, name))}")
        if set(self.device_state) & set(self.device_state_optional):
            raise ValueError("a layer's state is fixed on the device (device_state) or placed by the solver "
                             "(device_state_optional), not both")
        if frozenset(self.vocab_streamed) not in self.graph.vocab_sets() \
                or set(self.vocab_streamed) & set(self.device_capable):
            raise ValueError(f"vocab_streamed must be the prologue / epilogue whose vocabulary table can stream (a "
                             f"tied table: both), with no device state, got {sorted(self.vocab_streamed)}")
        if self.vocab_choices and (self.vocab_streamed or frozenset() not in self.vocab_choices
                                   or any(c not in self.graph.vocab_sets() or set(c) & set(self.device_state)
                                          for c in self.vocab_choices)):
            raise ValueError(f"vocab_choices must be sets of LayerGraph.vocab_sets, the resident one among them, "
                             f"none with a layer fixed on the device, with vocab_streamed empty, got "
                             f"{[sorted(c) for c in self.vocab_choices]}")
        if self.grads_streamable and self.graph.tied_table is not None and any(self.vocab_choices):
            raise ValueError("a streamed tied table's gradient is the sum of two uses: it cannot stream into the "
                             "update (grads_streamable): the choice of streaming it is not one of the model")
        if self.grads_streamable and self.tied_streamed:
            raise ValueError("a streamed tied table's gradient is the sum of two uses: it cannot stream into the "
                             "update (grads_streamable)")
        if isinstance(self.vocab_chunk_numel, bool) or not isinstance(self.vocab_chunk_numel, int) \
                or self.vocab_chunk_numel < 1:
            raise ValueError(f"vocab_chunk_numel must be a positive int, got {self.vocab_chunk_numel!r}")
        if self.device_state_sharded and (self.world_size == 1 or self.hosts > 1):
            raise ValueError("device_state_sharded needs several ranks of one host (world_size > 1, hosts == 1)")
        for name in ("host_offload_bytes", "host_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)!r}")
        if self.graph.saved_bytes_method == "aot-min-cut" and not self.compiled_blocks:
            raise ValueError("the graph counts kept activations as compiled blocks save them; eager blocks "
                             "save more: build it with compiled_blocks=False to plan eager blocks")

    @property
    def device_capable(self) -> frozenset:
        """The layers whose state is or may be on the device."""
        return frozenset(self.device_state) | frozenset(self.device_state_optional)

    @property
    def ranks_per_host(self) -> int:
        """The ranks that share one host's links, DRAM and CPU cores."""
        return self.world_size // self.hosts

    @property
    def n_blocks(self) -> int:
        return len(self.graph.layers) - 2

    @property
    def effective_loss_chunk_tokens(self) -> int:
        """Tokens whose logits the loss holds at once: a micro-batch's all where the model's own forward
        makes its logits (LayerGraph.linear_head false), else at most loss_chunk_tokens."""
        tokens = self.graph.batch_size * self.graph.seq_len
        return max(1, min(self.loss_chunk_tokens, tokens)) if self.graph.linear_head else tokens

    def with_vocab_streamed(self, choice: frozenset) -> "Problem":
        """This problem with the tables of `choice` streamed; a streamed tied table's gradient, the sum
        of its two uses, does not stream into the update (grads_streamable off)."""
        streamed = replace(self, vocab_streamed=choice, grads_streamable=False)
        return streamed if streamed.tied_streamed else replace(streamed, grads_streamable=self.grads_streamable)

    @property
    def tied_streamed(self) -> bool:
        """The tied table streams (for the prologue and the epilogue: LayerGraph.tied_table)."""
        return bool(self.vocab_streamed) and self.graph.tied_table is not None

    @property
    def vocab_chunk_rows(self) -> int:
        """Rows of one vocabulary chunk of a streamed table (costmodel.memory.vocab_chunk_rows)."""
        g = self.graph
        return vocab_chunk_rows(g.vocab_size, g.hidden_size, self.vocab_chunk_numel)

    def group_of(self, layer_id: int) -> str:
        kind = self.graph.layers[layer_id].kind
        return "blocks" if kind == BLOCK else kind


@dataclass(frozen=True)
class LayerChoice:
    chunks: int
    activation: str  # ACTIVATIONS (blocks); resident | streamed (prologue, epilogue)
    delivery: str = REPLICATED
    reduction: str = CPU
    host_copy: str = KEPT  # the delivery copy kept in host RAM, or made on load (KEPT, ON_LOAD)
    # The layer's fp32 master and AdamW moments on the device (Problem.device_state_optional: the
    # solver's choice; Problem.device_state: fixed there): no copies over PCIe, updated there.
    on_device: bool = False


@dataclass(frozen=True)
class Decisions:
    window: int
    update_order: str  # "forward": prologue, blocks, epilogue; "head_first": prologue, epilogue, blocks
    layers: tuple[LayerChoice, ...]
    # Early updates (one rank, no clipping): the host layers' updates in the CPU's order, each
    # starting once its gradient has landed in this step; () : all after the step boundary.
    early_order: tuple[int, ...] = ()
    # Host layers updated on the device at the step boundary, their fp32 master and moments streamed
    # up and back down (in this order, before any load of the next step); not on the CPU lane.
    streamed: tuple[int, ...] = ()
    # Every host layer's gradient streams into its update (Problem.grads_streamable): each chunk is
    # applied in place from the staging buffer it lands in, so the host keeps no gradient and no spare;
    # early_order is then every host layer in landing order.
    grads_streamed: bool = False

    @property
    def device_state(self) -> frozenset:
        """The layers whose optimizer state these decisions keep on the device."""
        return frozenset(i for i, c in enumerate(self.layers) if c.on_device)

    def order(self, n_layers: int) -> tuple[int, ...]:
        """Layer ids in CPU update order (also the order of the next step's weight loads)."""
        last = n_layers - 1
        blocks = tuple(range(1, last))
        return (0, last) + blocks if self.update_order == HEAD_FIRST else (0,) + blocks + (last,)

    def with_streamed_gradients(self, n_layers: int) -> "Decisions":
        """These decisions with every host layer's gradient streamed into its update (grads_streamed): no
        streamed updates, every layer whose state is on the host updated as it lands."""
        on_device = self.device_state
        return replace(self, streamed=(), early_order=tuple(i for i in landing_order(n_layers) if i not in on_device),
                       grads_streamed=True)

    def replace_layers(self, ids, **changes) -> "Decisions":
        ids = set(ids)
        return replace(self, layers=tuple(replace(c, **changes) if i in ids else c
                                          for i, c in enumerate(self.layers)))


def landing_order(n_layers: int) -> tuple[int, ...]:
    """Layer ids in the order their gradients reach the host within a pass: the blocks last to first,
    the prologue, the epilogue (the executor sends the resident layers' gradients after the prologue's
    backward, the head's tied use included)."""
    return tuple(range(n_layers - 2, -1, -1)) + (n_layers - 1,)


@dataclass(frozen=True)
class SolverOptions:
    """The values each decision may take, and the solver's settings."""

    windows: tuple[int, ...] = (1, 2, 3, 4)
    chunk_multiples: tuple[int, ...] = (1, 2, 4)  # a layer moves in multiple x world_size chunks
    activations: tuple[str, ...] = ACTIVATIONS
    # Routes, used when world_size > 1 and the GPUs have P2P. Leaving out the replicated delivery
    # or the CPU reduction forces the others (a benchmark of one route; without P2P the only way to
    # plan them, their collectives through host memory); with one rank only (replicated, cpu) exists,
    # and then such a choice is refused (ProblemCosts).
    deliveries: tuple[str, ...] = (REPLICATED, SHARDED)
    reductions: tuple[str, ...] = (CPU, GPU)
    update_orders: tuple[str, ...] = (FORWARD_ORDER, HEAD_FIRST)
    # Delivery copies (LayerChoice.host_copy); ON_LOAD only counts where Problem.copies_on_load.
    host_copies: tuple[str, ...] = (KEPT, ON_LOAD)
    # CP-SAT's deterministic time (its own work units; on a slow core one unit can take several
    # seconds of a large model) for all windows together: the search is reproducible whatever the
    # machine's load, unlike a wall-clock limit.
    deterministic_time: float = 1.0
    # Models of at most this many blocks get one CP-SAT model per window; larger ones only one, for
    # the window of the best plan found so far (the others keep the analytical lower bound), with
    # `large_deterministic_time`.
    all_windows_up_to_blocks: int = 16
    large_deterministic_time: float = 0.2
    local_search_evaluations: int = 200
    # Which layers keep their optimizer state on the device: None lets the CP-SAT model choose per
    # layer (device bandwidth known, and peer-to-peer between the GPUs for several ranks; solve.py),
    # an int fixes the first that many blocks (blocks + 1: the epilogue too). device_state_prologue:
    # the prologue's too (None: the model chooses; with a fixed device_state_blocks, None means no).
    device_state_blocks: int | None = None
    device_state_prologue: bool | None = None
    # Several ranks: the device state sharded by chunk owner (None: yes, the default with W > 1;
    # False: every rank keeps the same full copy). Ignored with one rank.
    device_state_sharded: bool | None = None
    # Streamed updates (Problem.streamed_updates): None lets the planner choose how many host layers,
    # an int fixes it (0: none).
    streamed_layers: int | None = None
    # Vocabulary streaming (Problem.vocab_streamed): None lets the CP-SAT model choose among the layers
    # that can stream (Problem.vocab_choices, solve._vocab_search); a tuple of "prologue" / "epilogue"
    # fixes it (() : none; a tied table: both).
    vocab_streamed: tuple[str, ...] | None = None
    vocab_chunk_numel: int = VOCAB_CHUNK_NUMEL
    seed: int = 0
    workers: int = 1
    hints: bool = True
    # Optional intervals per op and NoOverlap per lane, implied by the lane chains (they add
    # propagation, and cost time on large models). None: only for models that get every window.
    redundant_no_overlap: bool | None = None

    def __post_init__(self):
        for name in ("windows", "chunk_multiples"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"SolverOptions.{name} must be positive ints, got {values!r}")
        if not set(self.activations) <= set(ACTIVATIONS) or RECOMPUTE not in self.activations:
            raise ValueError(f"activations must include 'recompute' and be among {ACTIVATIONS}")
        if not self.deliveries or not set(self.deliveries) <= {REPLICATED, SHARDED}:
            raise ValueError(f"deliveries must be among {(REPLICATED, SHARDED)}, got {self.deliveries!r}")
        if KEPT not in self.host_copies or not set(self.host_copies) <= {KEPT, ON_LOAD}:
            raise ValueError(f"host_copies must include 'kept' and be among {(KEPT, ON_LOAD)}, got {self.host_copies!r}")
        if not self.reductions or not set(self.reductions) <= {CPU, GPU}:
            raise ValueError(f"reductions must be among {(CPU, GPU)}, got {self.reductions!r}")
        if self.device_state_blocks is not None and (isinstance(self.device_state_blocks, bool) or not isinstance(
                self.device_state_blocks, int) or self.device_state_blocks < 0):
            raise ValueError(f"device_state_blocks must be an int >= 0 or None, got {self.device_state_blocks!r}")
        if self.streamed_layers is not None and (isinstance(self.streamed_layers, bool) or not isinstance(
                self.streamed_layers, int) or self.streamed_layers < 0):
            raise ValueError(f"streamed_layers must be an int >= 0 or None, got {self.streamed_layers!r}")
        if self.vocab_streamed is not None and (not isinstance(self.vocab_streamed, tuple)
                                                or not set(self.vocab_streamed) <= {"prologue", "epilogue"}):
            raise ValueError(f"vocab_streamed must be None or a tuple of 'prologue' / 'epilogue', got "
                             f"{self.vocab_streamed!r}")
        if isinstance(self.vocab_chunk_numel, bool) or not isinstance(self.vocab_chunk_numel, int) \
                or self.vocab_chunk_numel < 1:
            raise ValueError(f"vocab_chunk_numel must be a positive int, got {self.vocab_chunk_numel!r}")
        if self.device_state_sharded not in (None, True, False):
            raise ValueError(f"device_state_sharded must be a bool or None, got {self.device_state_sharded!r}")
        if self.device_state_prologue not in (None, True, False):
            raise ValueError(f"device_state_prologue must be a bool or None, got {self.device_state_prologue!r}")
        if not self.update_orders or not set(self.update_orders) <= {FORWARD_ORDER, HEAD_FIRST}:
            raise ValueError(f"update_orders must be among {(FORWARD_ORDER, HEAD_FIRST)}")

    @property
    def forces_route(self) -> bool:
        """The replicated delivery or the CPU reduction is left out: only the sharded delivery or the
        GPU reduction may be planned (they need several ranks; without GPU peer-to-peer they are
        planned only so, their collectives going through host memory)."""
        return REPLICATED not in self.deliveries or CPU not in self.reductions
