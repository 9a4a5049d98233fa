"""The authoritative host state: fp32 master weights, AdamW moments, the delivery copy, gradients.

One anonymous shared-memory file (`memfd_create`) holds every array, page-aligned, per layer:

    master fp32 [n] | exp_avg fp32 [n] | exp_avg_sq fp32 [n] | delivery bf16 [n] | grad [n]
    [ | spare master fp32 [n] | spare exp_avg fp32 [n] | spare exp_avg_sq fp32 [n] ]

followed by a small control region of int64 counters (`StepFlags`, backend/state/step_flags.py) through
which ranks in other processes signal each other. `delivery` is the bf16 copy of the weights that the optimizer writes and H2D copies read (absent in
fp32 precision, and for the layers whose plan makes the copy on load: H2D reads `master` and the device
casts it). `grad` receives the gradient from the device (bf16 or
fp32, as computed). Other processes map the same memory through `/proc/<pid>/fd/<fd>` without a
copy, and because the file has no name, nothing is left in /dev/shm when the processes end. CUDA
pins it by registration (`pin()`, its pages first faulted in on every core), and `close()` always
unregisters before unmapping.

Layers whose optimizer state lives on the device of a one-rank engine (backend/state/device_state.py)
take no bytes here ("lean"): their master weights, moments and gradient live on the device alone;
their initial weights are loaded into it, and checkpoints, `state_dict` and exports read it, through a
bounded host staging buffer (backend/state/staging.py).

Layers whose gradient streams into the update (the plan's `streamed_gradients`: one rank, no clipping)
have no gradient array: each chunk's gradient is applied from the pinned staging buffer it lands in.

Layers updated during the backward out of place (backend/runtime/early_updates.py; not where the plan
writes them in place, plan.early_in_place) have a spare copy of master and moments: the update writes
there, and `swap_spare()` makes it current once the whole gradient is known to be finite; until then
the current arrays are untouched, so a step can still be taken back without a byte copied.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from slidedp.costmodel import memory as mem
from slidedp.ir.graph import LayerGraph

PAGE_BYTES = mem.HOST_PAGE_BYTES
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+ (Python 3.12 names it)


def _align(n: int, to: int = PAGE_BYTES) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ArraySpec:
    offset_bytes: int
    numel: int
    dtype: str  # "float32" | "bfloat16" | "int64"

    @property
    def nbytes(self) -> int:
        return self.numel * {"float32": 4, "bfloat16": 2, "int64": 8}[self.dtype]


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's arrays sit in the shared file, and where each parameter sits in them."""

    layer_id: int
    numel: int
    param_offsets: tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (name, start, numel, shape)
    master: ArraySpec
    exp_avg: ArraySpec
    exp_avg_sq: ArraySpec
    delivery: ArraySpec | None
    grad: ArraySpec | None  # None: the gradient streams into the update (no array here)
    spare: tuple[ArraySpec, ArraySpec, ArraySpec] | None = None  # master, exp_avg, exp_avg_sq
    lean: bool = False  # the state lives on the device alone: every array here is empty
    runs: tuple[tuple[int, int], ...] | None = None  # the layer's element ranges held here, packed (None: all)
    grad_dtype: str = "float32"  # the gradient's dtype ("bfloat16" | "float32"), held here or streamed

    @property
    def held_numel(self) -> int:
        """Elements of each array here: the layer's, or those of its runs (0 for a lean layer)."""
        return 0 if self.lean else self.numel if self.runs is None else sum(hi - lo for lo, hi in self.runs)


def plan_layout(graph: LayerGraph, *, delivery_bf16: bool, grad_dtype: str, control_ints: int = 0,
                spare_layers=(), lean_layers=(), no_copy_layers=(), no_grad_layers=(),
                held=None) -> tuple[list[LayerLayout], int, int]:
    """Page-aligned layout of every layer's arrays (with a spare master and moments for the layers
    in `spare_layers`; nothing but empty arrays for the `lean_layers`, whose optimizer state lives
    on the device of the engine's own process; no delivery copy for the `no_copy_layers`, whose loads
    read the master; no gradient for the `no_grad_layers`, whose gradient streams into the update
    from the staging buffers; only the element runs `held[layer id]` of the layers held in part, several hosts:
    `host_runs`), then `control_ints` int64 counters; returns (layouts, control region offset in
    bytes, total bytes)."""
    spare_layers, lean_layers, held = set(spare_layers), set(lean_layers), dict(held or {})
    no_copy_layers, no_grad_layers = set(no_copy_layers), set(no_grad_layers)
    if held and (spare_layers or lean_layers):
        raise ValueError("a host state held in part (several hosts) has no lean layers and no early updates")
    if spare_layers & lean_layers:
        raise ValueError(f"layers {sorted(spare_layers & lean_layers)} cannot be both lean and updated early")
    layouts, cursor = [], 0

    def take(numel: int, dtype: str) -> ArraySpec:
        nonlocal cursor
        spec = ArraySpec(cursor, numel, dtype)
        cursor = _align(cursor + spec.nbytes)
        return spec

    for layer in graph.layers:
        offsets, start = [], 0
        for p in layer.params:
            offsets.append((p.name, start, p.numel, p.shape))
            start += p.numel
        lean = layer.id in lean_layers
        runs = tuple(held[layer.id]) if layer.id in held else None
        n = 0 if lean else layer.numel if runs is None else sum(hi - lo for lo, hi in runs)  # the arrays' length
        layouts.append(
            LayerLayout(
                layer_id=layer.id,
                numel=layer.numel,
                param_offsets=tuple(offsets),
                master=take(n, "float32"),
                exp_avg=take(n, "float32"),
                exp_avg_sq=take(n, "float32"),
                delivery=take(n, "bfloat16") if delivery_bf16 and layer.id not in no_copy_layers else None,
                grad=take(n, grad_dtype) if layer.id not in no_grad_layers else None,
                spare=tuple(take(n, "float32") for _ in range(3)) if layer.id in spare_layers else None,
                lean=lean,
                runs=runs,
                grad_dtype=grad_dtype,
            )
        )
    control = take(control_ints, "int64").offset_bytes
    total = max(cursor, PAGE_BYTES)
    if delivery_bf16 == (grad_dtype == "bfloat16"):  # the count the planner and the preflight use
        assert total == mem.host_state_bytes([layout.numel if layout.lean else layout.held_numel for layout in layouts],
                                             2 if delivery_bf16 else 4,
                                             lean=lean_layers, spare=spare_layers, no_copy=no_copy_layers,
                                             no_grad=no_grad_layers,
                                             control_ints=control_ints)
    return layouts, control, total


class LayerArrays:
    """Torch and numpy views of one layer's arrays (zero-copy over the shared file)."""

    def __init__(self, buf: memoryview, layout: LayerLayout):
        self.layout = layout

        def tensor(spec: ArraySpec | None):
            if spec is None or spec.numel == 0:
                return None if spec is None else torch.empty(0, dtype=getattr(torch, spec.dtype))
            return torch.frombuffer(
                buf, dtype=getattr(torch, spec.dtype), count=spec.numel, offset=spec.offset_bytes
            )

        self.master = tensor(layout.master)
        self.exp_avg = tensor(layout.exp_avg)
        self.exp_avg_sq = tensor(layout.exp_avg_sq)
        self.delivery = tensor(layout.delivery)
        self.grad = tensor(layout.grad)
        self.spare = None if layout.spare is None else tuple(tensor(spec) for spec in layout.spare)

    @property
    def whole(self) -> bool:
        """Every element of the layer is held here (one host, or a layer kept whole on every host)."""
        return self.layout.runs is None

    def at(self, lo: int, hi: int) -> slice:
        """Where the layer's elements [lo, hi) sit in this host's arrays (inside one held run)."""
        runs = self.layout.runs
        if runs is None:
            return slice(lo, hi)
        base = 0
        for a, b in runs:
            if a <= lo and hi <= b:
                return slice(base + lo - a, base + hi - a)
            base += b - a
        raise IndexError(f"layer {self.layout.layer_id}: elements [{lo}, {hi}) are not held on this host")

    def held(self) -> list[tuple[int, int, slice]]:
        """(lo, hi, where here) of every run of the layer held here."""
        runs = self.layout.runs if self.layout.runs is not None else ((0, self.layout.numel),)
        out, base = [], 0
        for lo, hi in runs:
            out.append((lo, hi, slice(base, base + hi - lo)))
            base += hi - lo
        return out

    def swap_spare(self) -> None:
        """The spare master and moments (written by an out-of-place update) become current."""
        current = (self.master, self.exp_avg, self.exp_avg_sq)
        self.master, self.exp_avg, self.exp_avg_sq = self.spare
        self.spare = current

    @property
    def source(self) -> torch.Tensor:
        """What H2D copies read: the bf16 delivery copy, or the fp32 master (fp32 precision, or the copy
        made on load: the device casts what lands, round to nearest even as the optimizer writes it)."""
        return self.delivery if self.delivery is not None else self.master

    def param_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.whole and flat.numel() != self.layout.numel:
            raise ValueError(f"layer {self.layout.layer_id} is held in part on this host: its parameters have no views")
        return {
            name: flat[start : start + numel].view(shape)
            for name, start, numel, shape in self.layout.param_offsets
        }


class HostState:
    """All layers' arrays in one shared, registrable memory file.

    `HostState(graph, ...)` creates the file; `HostState.attach(handle)` maps the same file in
    another process of the same host (`handle()` says where it is: /proc/<pid>/fd/<fd>).
    """

    def __init__(self, graph: LayerGraph | None, *, delivery_bf16: bool, grad_dtype: str, control_ints: int = 0,
                 spare_layers=(), lean_layers=(), no_copy_layers=(), no_grad_layers=(), held=None,
                 _attach: tuple | None = None):
        if _attach is None:
            self.layouts, self.control_offset, self.nbytes = plan_layout(
                graph, delivery_bf16=delivery_bf16, grad_dtype=grad_dtype, control_ints=control_ints,
                spare_layers=spare_layers, lean_layers=lean_layers, no_copy_layers=no_copy_layers,
                no_grad_layers=no_grad_layers, held=held)
            self.fd = os.memfd_create("slidedp-host-state", os.MFD_CLOEXEC)
        else:
            path, self.layouts, self.control_offset, self.nbytes = _attach
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.control_ints = control_ints
        try:
            if _attach is None:
                os.ftruncate(self.fd, self.nbytes)
            self._mmap = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._buf = memoryview(self._mmap)
        self.layers = [LayerArrays(self._buf, layout) for layout in self.layouts]
        self.step = 0  # AdamW steps taken (bias correction)
        self._registered_ptr: int | None = None

    def handle(self) -> tuple:
        """What `HostState.attach` needs in another process (plain data)."""
        return (f"/proc/{os.getpid()}/fd/{self.fd}", self.layouts, self.control_offset, self.nbytes,
                self.control_ints)

    @classmethod
    def attach(cls, handle: tuple) -> "HostState":
        path, layouts, control_offset, nbytes, control_ints = handle
        return cls(None, delivery_bf16=False, grad_dtype="", control_ints=control_ints,
                   _attach=(path, layouts, control_offset, nbytes))

    def control(self) -> np.ndarray:
        """The int64 counters of the control region (shared with every process that maps the file)."""
        return np.frombuffer(self._buf, dtype=np.int64, count=self.control_ints, offset=self.control_offset)

    def allocated_bytes(self) -> int:
        """Bytes of memory the shared file takes now (its pages that have been written)."""
        return os.fstat(self.fd).st_blocks * 512

    @property
    def sharded(self) -> bool:
        """Some layer is held in part here (several hosts)."""
        return any(layout.runs is not None for layout in self.layouts)

    @property
    def base_ptr(self) -> int:
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=1).data_ptr()

    def populate(self, threads: int | None = None) -> bool:
        """Fault in every page of the file not yet written, `threads` ranges at once (default: one per
        core), contents unchanged (madvise MADV_POPULATE_WRITE). Registering the file then finds its pages
        present, where it would fault each in on one thread. False where the kernel cannot (before Linux
        5.14, or the advice refused): nothing done; OSError where memory runs out."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        threads = max(1, threads or os.cpu_count() or 1)
        step = -(-self.nbytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE  # page-aligned ranges
        base = self.base_ptr

        def fault_in(lo: int) -> int:  # ctypes lets the GIL go for the call
            if libc.madvise(base + lo, min(step, self.nbytes - lo), MADV_POPULATE_WRITE) == 0:
                return 0
            return ctypes.get_errno()

        with ThreadPoolExecutor(threads, thread_name_prefix="slidedp-populate") as pool:
            errors = set(pool.map(fault_in, range(0, self.nbytes, step))) - {0}
        if errno.ENOMEM in errors:
            raise OSError(errno.ENOMEM, f"not enough host memory to fault in the host state's {self.nbytes} bytes")
        return not errors  # else the kernel (or a sandbox) refused the advice: `pin` faults the pages in

    def pin(self) -> None:
        """Register the whole file with CUDA so H2D/D2H copies are DMA (cudaHostRegister), its pages
        faulted in first on every core (`populate`)."""
        if self._registered_ptr is not None or not torch.cuda.is_available():
            return
        self.populate()
        ptr = self.base_ptr
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with error {int(err)}")
        self._registered_ptr = ptr

    def close(self) -> None:
        """Unregister (if pinned), then unmap and close. Safe to call twice."""
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        if getattr(self, "_mmap", None) is None:
            return
        self.layers = []
        try:
            self._buf.release()
            self._mmap.close()
        except BufferError:
            pass  # a tensor view is still alive somewhere; the mapping goes with it
        self._mmap = None
        os.close(self.fd)

    def numpy(self, tensor: torch.Tensor) -> np.ndarray:
        """A numpy view (bf16 as uint16 bit patterns) for the Numba optimizer."""
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(np.uint16)
        return tensor.numpy()


def host_runs(plan, world_size: int, host: int, ranks_per_host: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """{layer id: element runs} that host `host` holds of each layer streamed from the host: the
    chunks its ranks (numbered host by host, `ranks_per_host` each) own in the plan; {} for one host.
    The layers whose state every rank keeps on its device are held whole (absent here)."""
    if world_size == ranks_per_host:
        return {}
    ranks = range(host * ranks_per_host, (host + 1) * ranks_per_host)
    on_device = set(plan.device_state)
    out = {}
    for d in plan.decisions:
        if d.layer_id in on_device:
            continue
        bounds = mem.chunk_bounds(d.numel, d.chunks)
        out[d.layer_id] = mem.held_runs(bounds, mem.chunk_owners(d.owners, len(bounds), world_size), ranks)
    return out
