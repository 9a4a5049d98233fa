"""slidedp's exceptions. Every one names what was wrong; none leaves anything allocated."""

from __future__ import annotations


class SlidedpError(Exception):
    """Base class of slidedp's own errors."""


class UnsupportedModelError(SlidedpError, TypeError):
    """The model lacks a structure slidedp needs (blocks, logits, ...); the message says which."""


class InfeasibleBudgetError(SlidedpError, ValueError):
    """No schedule fits the device-memory budget, or the host-memory budget.

    `min_budget_bytes` is the smallest device budget with which compile succeeds for the same
    workload; `min_host_bytes` the smallest host budget (`host_memory`) with which a plan exists under
    this device budget (at least the host state in its leanest layout plus the pinned buffers; None
    where not known), and `host_budget_bytes` the host budget planned for (None: unbounded).
    """

    def __init__(self, message: str, *, min_budget_bytes: int, budget_bytes: int, min_host_bytes: int | None = None,
                 host_budget_bytes: int | None = None):
        super().__init__(message)
        self.min_budget_bytes = int(min_budget_bytes)
        self.budget_bytes = int(budget_bytes)
        self.min_host_bytes = None if min_host_bytes is None else int(min_host_bytes)
        self.host_budget_bytes = None if host_budget_bytes is None else int(host_budget_bytes)


class NonFiniteGradientError(SlidedpError, FloatingPointError):
    """A non-finite gradient where training must stop: `compile(..., nonfinite="stop")` (the message says
    whether anything was applied), or non-finite steps repeating more often than `slidedp train` allows."""


class InsufficientMemoryError(SlidedpError, MemoryError):
    """Not enough host RAM, /dev/shm or free device memory for what compile would allocate.

    Raised by the preflight check (slidedp/run/preflight.py) before anything is allocated, with the
    numbers: `resource` ("host RAM", "/dev/shm" or "device memory"), `needed_bytes` and
    `available_bytes`.
    """

    def __init__(self, message: str, *, resource: str, needed_bytes: int, available_bytes: int):
        super().__init__(message)
        self.resource = resource
        self.needed_bytes = int(needed_bytes)
        self.available_bytes = int(available_bytes)


class TrainingInterrupted(SlidedpError):
    """`slidedp train` stopped at a step boundary on SIGINT/SIGTERM, after writing a checkpoint.

    `signum` is the signal, `step` the last completed step, `checkpoint` the folder written (or
    None when no step had run); `exit_code` is 128 + signum, as a shell reports a signal.
    """

    def __init__(self, message: str, *, signum: int, step: int, checkpoint: str | None):
        super().__init__(message)
        self.signum = int(signum)
        self.step = int(step)
        self.checkpoint = checkpoint
        self.exit_code = 128 + self.signum


class WorkerError(SlidedpError, RuntimeError):
    """A rank's worker process failed or died; `rank` names it. Every other rank was stopped."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank


class HostLostError(SlidedpError, RuntimeError):
    """Another host of a several-host run stopped (its processes died or no longer answer); the
    message names it (GROUP_RANK and hostname). `host` is its index (torchrun's GROUP_RANK)."""

    def __init__(self, message: str, *, host: int):
        super().__init__(message)
        self.host = int(host)
