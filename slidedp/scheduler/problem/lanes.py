"""The lanes of one step as the scheduler models it: ops on lanes, in program order (the backend lowers
the same order into stream ops, backend/lowering/program.py).

Every rank runs the same program (note [lockstep] in oracles/timeline.py). Its lanes:

  compute     prologue forward; blocks 1..N forward; epilogue (head + chunked loss, forward and
              backward); blocks N..1 backward (recompute first unless kept or offloaded); prologue
              backward. Compute positions 0 .. 2N+2 in that order are also the memory points.
  h2d         weight loads: prologue; epilogue here when the update order is head-first; blocks
              1..N into the `window` slots (Belady, see `window_loads`); epilogue here otherwise;
              a vocabulary-streamed head's second load (for its backward);
              then the backward reloads of evicted blocks and of offloaded activations (or offloaded
              block inputs: recompute_offload), by the compute position after which each may be issued.
  d2h         offloaded activations or block inputs (forward); the epilogue's gradient; blocks N..1;
              the prologue.
  collective  (W > 1) all-gather after each sharded load (a streamed head's second load too),
              reduce-scatter before each gpu-reduced gradient copy.
  cpu_update  the previous step's AdamW, chunk by chunk, in update order (per rank: the chunks
              it owns); built by the simulator, since it depends on the decisions.

An op waits for the ops named in `deps` (an absent op is no dependency) and for its lane.
Ops with a `when` condition exist only under those decisions. Forward loads are `chunkwise`:
piece c waits for the update of chunk c (the next step's forward needs this step's update).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from slidedp.costmodel import memory as mem
from slidedp.scheduler.plan import Load

COMPUTE, H2D, D2H, COLLECTIVE, CPU_UPDATE = "compute", "h2d", "d2h", "collective", "cpu_update"
GPU_LANES = (COMPUTE, H2D, D2H, COLLECTIVE)


def window_loads(n_blocks: int, window: int) -> tuple[Load, ...]:
    """Weight loads of a forward+backward visit of the blocks with `window` slots.

    Belady's eviction: empty slots first, then the content next used furthest away; among those,
    the slot used least recently (its copy may start earliest: at the turn every resident block is
    used once more and never again, and evicting the one used first lets the next reload overlap
    the other's backward), then the lowest slot. The executor must load in this order (it is the
    program the plan's timing assumes).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sequence = list(range(n_blocks)) + list(range(n_blocks - 1, -1, -1))
    content: list[int | None] = [None] * window
    last_use = [-1] * window
    loads = []

    def next_use(block, after):
        if block is None:
            return -1.0
        for q in range(after + 1, len(sequence)):
            if sequence[q] == block:
                return float(q)
        return float("inf")

    for p, block in enumerate(sequence):
        if block in content:
            slot = content.index(block)
        else:
            scores = [next_use(c, p) for c in content]
            slot = max(range(window), key=lambda s: (
                scores[s] if content[s] is not None else float("inf"), content[s] is None, -last_use[s], -s))
            loads.append(Load(p, block, slot, last_use[slot]))
            content[slot] = block
        last_use[slot] = p
    return tuple(loads)


@dataclass(frozen=True)
class Op:
    key: str  # structural name, e.g. "load[L3,fwd]"
    lane: str
    kind: str  # fwd | epi | bwd | load | reload | offload | grad | all_gather | reduce_scatter
    layer: int
    deps: tuple[str, ...] = ()
    # all must hold: ("offload", i) (block i offloads: decisions.OFFLOADED) ("sharded", i) ("gpu", i) ("order", o)
    when: tuple[tuple, ...] = ()
    chunkwise: bool = False  # forward load: piece c waits for the update of chunk c
    phase: str = "fwd"  # fwd | bwd: which transfer rates apply
    position: int = -1  # compute position (compute lane only)


@dataclass(frozen=True)
class Lanes:
    n_blocks: int
    window: int
    lanes: dict  # lane -> tuple[Op, ...] in program order (GPU lanes of one rank)
    compute_keys: tuple[str, ...]  # key of the compute op at each position

    @property
    def epilogue(self) -> int:
        return self.n_blocks + 1

    def fwd_position(self, block_id: int) -> int:
        return block_id

    def bwd_position(self, block_id: int) -> int:
        return 2 * self.n_blocks + 2 - block_id


@lru_cache(maxsize=64)
def build_lanes(n_blocks: int, window: int, collectives: bool, head_reload: bool = False) -> Lanes:
    """The GPU lanes of one rank for N blocks and a window (cached: it is pure structure).
    `head_reload`: the epilogue's table streams by vocabulary chunk and is loaded again for its
    backward (`load[LE,head]`, after its forward load; the epilogue waits for both)."""
    N, E = n_blocks, n_blocks + 1
    window = min(window, N)
    loads = window_loads(N, window)

    def cpos(visit: int) -> int:  # block visit -> compute position
        return visit + 1 if visit < N else visit + 2

    def bp(i: int) -> int:
        return 2 * N + 2 - i

    compute_keys = (["fwd[L0]"] + [f"fwd[L{i}]" for i in range(1, N + 1)] + [f"epi[L{E}]"]
                    + [f"bwd[L{i}]" for i in range(N, 0, -1)] + ["bwd[L0]"])
    bwd_loads = {ld.block + 1: ld for ld in loads if ld.position >= N}
    fwd_loads = [ld for ld in loads if ld.position < N]
    head_first, forward = ("order", "head_first"), ("order", "forward")

    compute = [Op("fwd[L0]", COMPUTE, "fwd", 0, ("load[L0]", "all_gather[L0]"), position=0)]
    for i in range(1, N + 1):
        deps = [f"load[L{i},fwd]", f"all_gather[L{i},fwd]"]
        if i - 2 >= 1:
            deps.append(f"offload[L{i - 2}]")  # its device buffer is reused two blocks later
        compute.append(Op(f"fwd[L{i}]", COMPUTE, "fwd", i, tuple(deps), position=i))
    deps = [f"load[L{E},early]", f"load[L{E},late]", f"all_gather[L{E},early]", f"all_gather[L{E},late]"]
    deps += [f"load[L{E},head]", f"all_gather[L{E},head]"] if head_reload else []
    if N - 1 >= 1:
        deps.append(f"offload[L{N - 1}]")
    compute.append(Op(f"epi[L{E}]", COMPUTE, "epi", E, tuple(deps), position=N + 1))
    for i in range(N, 0, -1):
        deps = []
        if i in bwd_loads:
            deps += [f"load[L{i},bwd]", f"all_gather[L{i},bwd]"]
        deps.append(f"reload[L{i}]")
        if i == N:
            deps.append(f"offload[L{N}]")
        if i + mem.GRAD_ACCUMULATORS <= N:  # the accumulator of i+2 must be drained (backend/lowering/program.py)
            deps.append(f"grad[L{i + mem.GRAD_ACCUMULATORS}]")
        compute.append(Op(f"bwd[L{i}]", COMPUTE, "bwd", i, tuple(deps), phase="bwd", position=bp(i)))
    compute.append(Op("bwd[L0]", COMPUTE, "bwd", 0, (), phase="bwd", position=2 * N + 2))

    def slot_dep(ld: Load) -> tuple[str, ...]:
        return (compute_keys[cpos(ld.issue_after)],) if ld.issue_after >= 0 else ()

    h2d = [Op("load[L0]", H2D, "load", 0, (), chunkwise=True)]
    h2d.append(Op(f"load[L{E},early]", H2D, "load", E, (), (head_first,), chunkwise=True))
    for ld in fwd_loads:
        i = ld.block + 1
        h2d.append(Op(f"load[L{i},fwd]", H2D, "load", i, slot_dep(ld), chunkwise=True))
    h2d.append(Op(f"load[L{E},late]", H2D, "load", E, (), (forward,), chunkwise=True))
    if head_reload:
        h2d.append(Op(f"load[L{E},head]", H2D, "load", E, (f"load[L{E},early]", f"load[L{E},late]"), phase="bwd"))
    backward = []
    for i, ld in bwd_loads.items():
        backward.append(((cpos(ld.issue_after), 0, -i),
                         Op(f"load[L{i},bwd]", H2D, "load", i, slot_dep(ld), phase="bwd")))
    for i in range(1, N + 1):
        after = bp(i) - 2
        backward.append(((after, 1, -i), Op(f"reload[L{i}]", H2D, "reload", i,
                                            (f"offload[L{i}]", compute_keys[after]), (("offload", i),),
                                            phase="bwd")))
    h2d += [op for _, op in sorted(backward, key=lambda kv: kv[0])]

    d2h = [Op(f"offload[L{i}]", D2H, "offload", i, (f"fwd[L{i}]",), (("offload", i),))
           for i in range(1, N + 1)]
    d2h.append(Op(f"grad[L{E}]", D2H, "grad", E, (f"epi[L{E}]", f"reduce_scatter[L{E}]"), phase="bwd"))
    for i in range(N, 0, -1):
        d2h.append(Op(f"grad[L{i}]", D2H, "grad", i, (f"bwd[L{i}]", f"reduce_scatter[L{i}]"), phase="bwd"))
    d2h.append(Op("grad[L0]", D2H, "grad", 0, ("bwd[L0]", "reduce_scatter[L0]"), phase="bwd"))

    coll = []
    if collectives:
        coll.append(Op("all_gather[L0]", COLLECTIVE, "all_gather", 0, ("load[L0]",), (("sharded", 0),)))
        coll.append(Op(f"all_gather[L{E},early]", COLLECTIVE, "all_gather", E, (f"load[L{E},early]",),
                       (("sharded", E), head_first)))
        for ld in fwd_loads:
            i = ld.block + 1
            coll.append(Op(f"all_gather[L{i},fwd]", COLLECTIVE, "all_gather", i, (f"load[L{i},fwd]",),
                           (("sharded", i),)))
        coll.append(Op(f"all_gather[L{E},late]", COLLECTIVE, "all_gather", E, (f"load[L{E},late]",),
                       (("sharded", E), forward)))
        if head_reload:  # the streamed head's second load, sharded: its chunks gathered again
            coll.append(Op(f"all_gather[L{E},head]", COLLECTIVE, "all_gather", E, (f"load[L{E},head]",),
                           (("sharded", E),), phase="bwd"))
        coll.append(Op(f"reduce_scatter[L{E}]", COLLECTIVE, "reduce_scatter", E, (f"epi[L{E}]",),
                       (("gpu", E),), phase="bwd"))
        backward = []
        for i in range(N, 0, -1):
            backward.append(((bp(i), 0, -i), Op(f"reduce_scatter[L{i}]", COLLECTIVE, "reduce_scatter", i,
                                                (f"bwd[L{i}]",), (("gpu", i),), phase="bwd")))
        for i, ld in bwd_loads.items():
            backward.append(((cpos(ld.issue_after), 1, -i),
                             Op(f"all_gather[L{i},bwd]", COLLECTIVE, "all_gather", i, (f"load[L{i},bwd]",),
                                (("sharded", i),), phase="bwd")))
        backward.append(((2 * N + 2, 0, 0), Op("reduce_scatter[L0]", COLLECTIVE, "reduce_scatter", 0,
                                                ("bwd[L0]",), (("gpu", 0),), phase="bwd")))
        coll += [op for _, op in sorted(backward, key=lambda kv: kv[0])]

    lanes = {COMPUTE: tuple(compute), H2D: tuple(h2d), D2H: tuple(d2h), COLLECTIVE: tuple(coll)}
    return Lanes(N, window, lanes, tuple(compute_keys))
