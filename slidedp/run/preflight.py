"""Preflight: before `compile` allocates anything, check that the memory it needs is there.

What compile allocates:

- host RAM: the plan's `peak_host_bytes` (`Explanation.host_memory`, counted by
  costmodel.memory.host_memory, the count the planner bounds by `host_memory`): the host state (fp32
  master weights, both AdamW moments, the bf16 delivery copy and the gradient of every layer,
  page-aligned, as `backend.state.host_state.plan_layout` lays it out; pinned on CUDA by registration,
  the same bytes), early updates' spare state, offloaded activations and pinned staging buffers; on
  the CPU the "device" buffers of the plan (weight window, activations, loss chunks:
  `plan.peak_device_bytes`) are host RAM too;
- /dev/shm: whatever is placed there (`shm_bytes`; the single-process host state is an anonymous
  `memfd`, which /dev/shm's size does not limit, so compile passes 0);
- device memory: the plan's peak (`plan.peak_device_bytes`, at most the budget) against what
  `torch.cuda.mem_get_info` reports free.

Available figures: host RAM is `MemAvailable` of /proc/meminfo, lowered to what the cgroup (v2 or
v1) still allows when the process runs under a memory limit (a container), since that limit, not
the machine's RAM, is what the kernel's OOM killer enforces; /dev/shm is `os.statvfs` free space.
A figure that cannot be read is not checked. The check refuses with the numbers
(`InsufficientMemoryError`) rather than letting the kernel kill the process later.

Everything here is a small pure function, except `available_memory`, which reads the machine;
tests pass their own figures (or monkeypatch `available_memory`). `SLIDEDP_SKIP_PREFLIGHT=1`
switches the check off (e.g. with swap, where "available" understates what works).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from slidedp.budget import format_bytes
from slidedp.costmodel import memory as mem
from slidedp.errors import InsufficientMemoryError
from slidedp.scheduler.plan import host_activation_bytes

#: Host RAM left for everything else of the process (the model's Python objects, the tokenizer,
#: data, libraries) on top of what compile allocates.
HOST_HEADROOM_BYTES = 256 << 20
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Available:
    """Free memory, in bytes; None: unknown (not checked)."""

    host_bytes: int | None = None
    shm_bytes: int | None = None
    device_bytes: int | None = None


@dataclass(frozen=True)
class Needs:
    """What compile will allocate, in bytes."""

    host_state_bytes: int  # master + moments + delivery + gradients (shared or not)
    host_other_bytes: int = 0  # other host buffers (CPU "device" buffers, pinned staging)
    shm_bytes: int = 0  # bytes placed in /dev/shm
    device_bytes: int = 0  # device memory (CUDA)

    @property
    def host_bytes(self) -> int:
        return self.host_state_bytes + self.host_other_bytes


def meminfo_available_bytes(text: str) -> int | None:
    """`MemAvailable` (bytes) from the text of /proc/meminfo; None if absent."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * (1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1)
    return None


def cgroup_available_bytes(limit_text: str | None, usage_text: str | None) -> int | None:
    """What a cgroup memory limit still allows (limit - usage), from the texts of its files
    (v2: memory.max, memory.current; v1: memory.limit_in_bytes, memory.usage_in_bytes); None
    when there is no limit ("max" or a huge number) or the figures are unreadable."""
    if limit_text is None or usage_text is None:
        return None
    limit_text = limit_text.strip()
    if limit_text == "max":
        return None
    try:
        limit, usage = int(limit_text), int(usage_text.strip())
    except ValueError:
        return None
    if limit >= _UNLIMITED:
        return None
    return max(0, limit - usage)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def host_available_bytes() -> int | None:
    """MemAvailable, lowered to the cgroup's remaining allowance where there is a limit."""
    text = _read("/proc/meminfo")
    figures = [meminfo_available_bytes(text) if text else None]
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        figures.append(cgroup_available_bytes(_read(limit), _read(usage)))
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def shm_available_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes of the /dev/shm file system (None if there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def device_available_bytes(device) -> int | None:
    """Free memory of a CUDA device (torch.cuda.mem_get_info); None for other devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def available_memory(device) -> Available:
    """The machine's free host RAM, /dev/shm and device memory now."""
    return Available(host_bytes=host_available_bytes(), shm_bytes=shm_available_bytes(),
                     device_bytes=device_available_bytes(device))


def host_state_bytes(graph, *, precision: str, control_ints: int = 0, spare_layers=(), lean_layers=()) -> int:
    """Bytes of the host state `compile` makes for `graph` (bf16: with the delivery copy and bf16
    gradients; fp32: fp32 gradients, no delivery copy; a spare master and moments for the layers
    updated early): costmodel.memory.host_state_bytes, the count the planner uses."""
    return mem.host_state_bytes([layer.numel for layer in graph.layers], 2 if precision == "bf16" else 4,
                                lean=lean_layers, spare=spare_layers, control_ints=control_ints)


def offloaded_activation_bytes(graph, plan) -> int:
    """Host memory (pinned) that the plan's offloaded activations take per rank in a pass: for every
    offloading block, what it puts on the host per micro-batch (its saved activations, or its input
    for recompute_offload: plan.host_activation_bytes) times the micro-batches."""
    policy = plan.activation_policy()
    return plan.workload.micro_batches * sum(host_activation_bytes(layer, policy.get(layer.id, ""))
                                             for layer in graph.layers)


def plan_host_memory(graph, plan, *, precision: str, world_size: int = 1, lean_layers=(),
                     numels=None) -> dict[str, int]:
    """Host RAM of the plan by category, all ranks of this host (costmodel.memory.host_memory): the
    plan's own `host_memory` when it has one for this layout (the lean layers a one-rank plan
    assumes), else the same count made here from its schedule (a plan saved without its explanation;
    a rank in a worker process, whose host state is not lean; one host of several, holding `numels`
    parameters of each layer: backend/state/host_state.py host_runs)."""
    planned_lean = tuple(plan.device_state) if plan.workload.world_size == 1 else ()
    if plan.host_memory and tuple(sorted(lean_layers)) == tuple(sorted(planned_lean)) \
            and world_size == plan.workload.world_size and numels is None:
        return dict(plan.host_memory)
    numels = [layer.numel for layer in graph.layers] if numels is None else list(numels)
    return mem.host_memory(numels, 2 if precision == "bf16" else 4,
                           world_size=world_size, lean=lean_layers,
                           spare=plan.spare_layers(),
                           no_copy=plan.copies_made_on_load(), no_grad=plan.streamed_gradient_layers(),
                           offloaded_bytes=world_size * offloaded_activation_bytes(graph, plan),
                           max_chunk_numel=max((-(-d.numel // max(1, d.chunks)) for d in plan.decisions
                                                if d.layer_id not in set(plan.device_state)), default=0))


def compile_needs(graph, plan, device, *, precision: str, world_size: int = 1, control_ints: int = 0,
                  lean_layers=(), numels=None) -> Needs:
    """What `compile` allocates for this graph and plan on this device: the plan's host memory
    (`plan_host_memory`: one host state shared by the ranks, spare state, offloaded activations,
    pinned buffers), and the plan's device peak per rank (host RAM when the ranks are CPU processes).
    `control_ints` is implied by the plan (costmodel.memory.step_flag_ints) and kept for callers."""
    device_bytes = int(plan.peak_device_bytes or 0)
    on_cpu = torch.device(device).type == "cpu"
    host = plan_host_memory(graph, plan, precision=precision, world_size=world_size, lean_layers=lean_layers,
                            numels=numels)
    return Needs(host_state_bytes=host["state"] + host["spare"],
                 host_other_bytes=(device_bytes * world_size if on_cpu else 0) + host["offloaded_activations"]
                 + host["pinned_buffers"] + host.get("load_staging", 0),
                 device_bytes=0 if on_cpu else device_bytes)


def check_memory(needs: Needs, available: Available, *, headroom_bytes: int = HOST_HEADROOM_BYTES) -> None:
    """Refuse (InsufficientMemoryError, with the numbers) when a need exceeds what is available."""
    if available.host_bytes is not None and needs.host_bytes + headroom_bytes > available.host_bytes:
        raise InsufficientMemoryError(
            f"not enough host RAM: this model needs {format_bytes(needs.host_bytes)} "
            f"({needs.host_bytes} bytes: host state {format_bytes(needs.host_state_bytes)} for the fp32 master "
            f"weights, both AdamW moments and the gradients, plus {format_bytes(needs.host_other_bytes)} of "
            f"other buffers) and {format_bytes(headroom_bytes)} of headroom, but only "
            f"{format_bytes(available.host_bytes)} ({available.host_bytes} bytes) is available "
            "(MemAvailable, or the cgroup limit); free memory or use a machine with more RAM "
            "(SLIDEDP_SKIP_PREFLIGHT=1 skips this check)",
            resource="host RAM", needed_bytes=needs.host_bytes + headroom_bytes,
            available_bytes=available.host_bytes)
    if available.shm_bytes is not None and needs.shm_bytes > available.shm_bytes:
        raise InsufficientMemoryError(
            f"not enough shared memory: {format_bytes(needs.shm_bytes)} ({needs.shm_bytes} bytes) would be "
            f"placed in /dev/shm, which has {format_bytes(available.shm_bytes)} ({available.shm_bytes} bytes) "
            "free; enlarge it (e.g. docker --shm-size) (SLIDEDP_SKIP_PREFLIGHT=1 skips this check)",
            resource="/dev/shm", needed_bytes=needs.shm_bytes, available_bytes=available.shm_bytes)
    if available.device_bytes is not None and needs.device_bytes > available.device_bytes:
        raise InsufficientMemoryError(
            f"not enough free device memory: the plan's peak is {format_bytes(needs.device_bytes)} "
            f"({needs.device_bytes} bytes) but the GPU has {format_bytes(available.device_bytes)} "
            f"({available.device_bytes} bytes) free; give a smaller budget or free the GPU "
            "(SLIDEDP_SKIP_PREFLIGHT=1 skips this check)",
            resource="device memory", needed_bytes=needs.device_bytes, available_bytes=available.device_bytes)


def check_compile(graph, plan, device, *, precision: str, world_size: int = 1, control_ints: int = 0,
                  lean_layers=(), numels=None, available: Available | None = None) -> Needs:
    """The preflight of `compile`: what it will allocate against what the machine has free (the
    device figure is that of `device`, the device the caller will use; every GPU of a host with
    several ranks is assumed alike; `numels`: the parameters of each layer this host holds, one host
    of several)."""
    needs = compile_needs(graph, plan, device, precision=precision, world_size=world_size,
                          control_ints=control_ints, lean_layers=lean_layers, numels=numels)
    if os.environ.get("SLIDEDP_SKIP_PREFLIGHT", "") not in ("", "0"):
        return needs
    check_memory(needs, available if available is not None else available_memory(device))
    return needs
