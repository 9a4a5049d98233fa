"""Early updates: each layer's AdamW update starts as soon as its gradient lands, during the backward.

Without gradient clipping, a layer's update needs only its own gradient, except for one global fact:
whether the whole gradient is finite (if not, the step is skipped and no state may change). So a
step's round of updates starts with its last pass over the weights: the update of layer i waits for
its gradient to be complete on the host, then runs *out of place*, reading the current master and
moments and writing the spare ones (host_state.py; the bf16 delivery copy is written too, which no
load of this step reads any more). Once the norm is known:

- finite: `commit()` makes every spare of the round current (pointer swaps, nothing copied; the
  update thread runs the rest of the round into the arrays it captured at the start);
- not finite, or the step failed: `take_back()` waits for the round, then rewrites the delivery copy
  of every layer it touched from the untouched master: the state is exactly as before the step.

The result is bit for bit that of the same AdamW after the backward (the out-of-place kernel is the
in-place one's arithmetic). The round's order (the plan's `early_order`) is what the program
simulator assumes: the layers in the order their gradients land first, then the rest in the order
the next step loads them.

In place (`in_place`, plan.early_in_place: no clipping and nonfinite="stop", no spare state): each
update writes over the state it reads, which costs the CPU fewer bytes (a store to a line already read
reads nothing more) and the host no spare; `commit()` has nothing to swap, and a round that cannot be
kept (a non-finite gradient, a failed step) is stopped but not undone: `take_back()` returns the layers
already written, the state is that of a step part-applied (rank.py refuses steps, run/engine.py
checkpoints and exports, until a checkpoint loads).
"""

from __future__ import annotations

import threading
from typing import Callable

from slidedp.backend.state.host_state import HostState


class EarlyRound:
    """One step's updates during its backward: which layers have landed, and whether to keep them."""

    def __init__(self, order: list[int]):
        self.order = list(order)
        self.landed = {layer_id: threading.Event() for layer_id in order}
        self.wait_landed: dict[int, Callable[[], None]] = {}
        self.cancelled = False
        self.updated: list[int] = []  # layers whose spare holds this round's update

    def land(self, layer_id: int, wait: Callable[[], None]) -> None:
        """The gradient of `layer_id` is complete once `wait()` returns (called by the routes)."""
        if layer_id in self.landed:
            self.wait_landed[layer_id] = wait
            self.landed[layer_id].set()

    def cancel(self) -> None:
        """No more updates of this round start (the step failed or is skipped)."""
        self.cancelled = True
        for event in self.landed.values():
            event.set()


class EarlyUpdates:
    """Starts, commits and takes back the rounds of early updates of one rank."""

    def __init__(self, host: HostState, order: list[int], updates, on_swap: Callable[[list[int]], None],
                 in_place: bool = False):
        missing = [i for i in order if host.layers[i].spare is None]
        if missing and not in_place:
            raise ValueError(f"layers {missing} have no spare master and moments in the host state")
        self.host, self.order, self.updates, self.on_swap = host, list(order), updates, on_swap
        self.in_place = in_place
        self.round: EarlyRound | None = None

    def start(self, update: Callable[[int, tuple, int | None], None]) -> EarlyRound:
        """Start a round: for each layer in order, wait for its gradient, then
        `update(layer_id, (master, exp_avg, exp_avg_sq, spare), num_threads)` (captured now, so a
        commit before the layer's turn does not change what the update reads and writes), or in place
        `update(layer_id, None, num_threads)`."""
        rnd = EarlyRound(self.order)
        arrays = {i: None if self.in_place else (a.master, a.exp_avg, a.exp_avg_sq, a.spare)
                  for i, a in ((i, self.host.layers[i]) for i in self.order)}

        def run(layer_id: int, num_threads: int | None) -> None:
            rnd.landed[layer_id].wait()
            if rnd.cancelled:
                return
            rnd.wait_landed[layer_id]()
            if rnd.cancelled:
                return
            update(layer_id, arrays[layer_id], num_threads)
            rnd.updated.append(layer_id)

        self.round = rnd
        self.updates.start(run, self.order)
        return rnd

    def commit(self) -> None:
        """The gradient is finite: the round's spares become current, for every layer of the round (in
        place: the round goes on writing where it reads)."""
        rnd, self.round = self.round, None
        if self.in_place:
            return
        for layer_id in rnd.order:
            self.host.layers[layer_id].swap_spare()
        self.on_swap(rnd.order)

    def take_back(self) -> list[int]:
        """Undo the round (non-finite gradient or a failed step): stop it, wait for the update in
        flight, rewrite the delivery copy of the layers it updated from their master. Returns them.
        In place: stop it and wait; the layers returned were written and stay so."""
        rnd, self.round = self.round, None
        if rnd is None:
            return []
        rnd.cancel()
        self.updates.flush()
        if self.in_place:
            return list(rnd.updated)
        for layer_id in rnd.updated:
            arrays = self.host.layers[layer_id]
            if arrays.delivery is not None:
                arrays.delivery.copy_(arrays.master)  # bf16, round to nearest even, as the optimizer writes it
        return list(rnd.updated)
