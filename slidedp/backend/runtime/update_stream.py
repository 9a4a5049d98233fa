"""The CPU updates of step t, overlapped with later GPU work, without changing the step's semantics.

Updates run on one background thread, a round (one step's updates) at a time, layer by layer in
the round's order. Loads wait for a layer's update of the round *gated* at the start of the step
(`gate()`: the last round started before it), never for a round started during the step:

- after the backward (the step boundary, needed when the gradient norm clips every update, or
  with several ranks), step t's round starts once its whole gradient is known, in the plan's
  update order (prologue, blocks in forward order, epilogue: the order in which the next step reads
  them), while step t+1's forward already runs; step t+1 waits for layer i's update before it
  copies layer i's weights to the device or overwrites its gradient, so the result is exactly that
  of updating everything before the next step begins;
- during the backward (early updates, backend/runtime/early_updates.py), step t's round starts with the
  last pass and each update first waits for its layer's gradient to land; step t's own loads still
  wait only for step t-1's round.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class UpdateStream:
    def __init__(self, order: list[int], num_threads: int | None):
        self.order = list(order)
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slidedp-update")
        self._latest: dict[int, threading.Event] = {}  # the last round started
        self._done: dict[int, threading.Event] = {}  # the round loads wait for (gate())
        self._futures: list[Future] = []
        self.last_duration_s = 0.0  # wall time of the last finished round of updates

    def start(self, update: Callable[[int, int | None], None], order: list[int] | None = None) -> None:
        """Run `update(layer_id, num_threads)` for every layer of `order` (default: the update
        order) in the background, after every round started before."""
        order = self.order if order is None else list(order)
        done = {layer_id: threading.Event() for layer_id in order}

        def run() -> None:
            t0 = time.perf_counter()
            for layer_id in order:
                update(layer_id, self.num_threads)
                done[layer_id].set()
            self.last_duration_s = time.perf_counter() - t0

        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        self._futures.append(self._pool.submit(run))
        self._latest = done

    def gate(self) -> None:
        """From now on `wait` waits for the last round started (call at the start of a step)."""
        self._done = self._latest

    def wait(self, layer_id: int) -> None:
        """Block until layer `layer_id`'s update of the gated round (if any) has finished; re-raise
        an update's error."""
        event = self._done.get(layer_id)
        if event is None or event.is_set():
            return
        while not event.wait(0.05):
            self.check()
            if self._done.get(layer_id) is not event:
                return  # flushed meanwhile

    def check(self) -> None:
        """Re-raise a background update's exception, if one failed."""
        if any(f.done() and f.exception() is not None for f in self._futures):
            self.flush()  # raises the update's exception, once

    def flush(self) -> None:
        """Wait for every pending update."""
        futures, self._futures = self._futures, []
        try:
            for future in futures:
                future.result()
        finally:
            if futures:
                self._latest, self._done = {}, {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
