"""Counters in the shared host state through which the ranks' processes signal each other.

Ranks run in separate processes that map the same host-state file (host_state.py); these int64
counters live in its control region. Each is written by one rank and read by others, and every
write follows the data it announces (x86 stores become visible in program order; a Numba or torch
call that wrote the data has joined its threads before it returns).

- `updated[r, layer]`: how many update rounds rank r (of this host) has finished for `layer` (its owned chunks).
  Before a rank reads a layer's weights or overwrites its gradient, every rank's count must have
  reached the number of rounds started (`wait_updated`).
- `contributions[layer]`: how many rank contributions the layer's host gradient holds, counted
  over the passes of the whole run. With CPU reduction, rank r adds its gradient of pass g when
  the count is g*W + r (`wait_turn`), so the sum is taken in rank order: deterministic.
- `abort`: 0, or 1 + the rank that failed; every wait raises once it is set.
"""

from __future__ import annotations

import time

import numpy as np

from slidedp.costmodel import memory as mem


class RankFailed(RuntimeError):
    """Another rank failed; this one stops."""


class StepFlags:
    """The counters of the ranks that share one host state: `world_size` ranks numbered from
    `first_rank` (0 on one host; with several hosts, each host's ranks, whose global numbers run
    from host * ranks per host; the methods take global rank numbers)."""

    def __init__(self, control: np.ndarray, world_size: int, n_layers: int, *, first_rank: int = 0):
        if control.size < self.ints_needed(world_size, n_layers):
            raise ValueError(f"control region has {control.size} counters, {self.ints_needed(world_size, n_layers)} needed")
        self.world_size, self.n_layers, self.first_rank = world_size, n_layers, first_rank
        self._abort = control[0:1]
        self.updated = control[1 : 1 + world_size * n_layers].reshape(world_size, n_layers)
        self.contributions = control[1 + world_size * n_layers : 1 + (world_size + 1) * n_layers]
        self.on_wait = lambda: None  # called while waiting: re-raises a local failure

    @staticmethod
    def ints_needed(world_size: int, n_layers: int) -> int:
        return mem.step_flag_ints(world_size, n_layers)

    # -- failure --------------------------------------------------------------------------------
    def abort(self, rank: int) -> None:
        if int(self._abort[0]) == 0:
            self._abort[0] = rank + 1

    def failed_rank(self) -> int | None:
        value = int(self._abort[0])
        return value - 1 if value else None

    def _check(self) -> None:
        failed = self.failed_rank()
        if failed is not None:
            raise RankFailed(f"rank {failed} failed; stopping")
        self.on_wait()

    def _wait(self, ready) -> float:
        """Poll `ready()` with a short back-off; returns the seconds waited."""
        if ready():
            return 0.0
        t0, pause = time.perf_counter(), 20e-6
        while not ready():
            self._check()
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return time.perf_counter() - t0

    # -- updates --------------------------------------------------------------------------------
    def mark_updated(self, rank: int, layer: int, rounds: int) -> None:
        self.updated[rank - self.first_rank, layer] = rounds

    def wait_updated(self, layer: int, rounds: int) -> float:
        """Block until every rank of this host has finished `rounds` update rounds of `layer` (ranks
        of other hosts update chunks that no rank here reads from this host)."""
        column = self.updated[:, layer]
        return self._wait(lambda: int(column.min()) >= rounds)

    # -- CPU reduction --------------------------------------------------------------------------
    def wait_turn(self, layer: int, ticket: int) -> float:
        return self._wait(lambda: int(self.contributions[layer]) == ticket)

    def advance(self, layer: int, ticket: int) -> None:
        self.contributions[layer] = ticket + 1
