"""The CPU update of step t, overlapped with step t+1, without changing the step's semantics.

The gradient norm and the finite check need every gradient, so a step's updates can only start
once its backward is complete. They then run on one background thread, layer by layer in the
plan's update order (prologue, blocks in forward order, epilogue: the order in which the next
step reads them), while the next step's forward already runs on the GPU. The next step waits for
layer i's update before it copies layer i's weights to the device or overwrites its gradient, so
the result is exactly that of updating everything before the next step begins.
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
        self._done: dict[int, threading.Event] = {}
        self._future: Future | None = None
        self.last_duration_s = 0.0  # wall time of the last finished round of updates

    def start(self, update: Callable[[int, int | None], None]) -> None:
        """Run `update(layer_id, num_threads)` for every layer in order, in the background."""
        self.flush()
        done = {layer_id: threading.Event() for layer_id in self.order}

        def run() -> None:
            t0 = time.perf_counter()
            for layer_id in self.order:
                update(layer_id, self.num_threads)
                done[layer_id].set()
            self.last_duration_s = time.perf_counter() - t0

        self._done = done
        self._future = self._pool.submit(run)

    def wait(self, layer_id: int) -> None:
        """Block until layer `layer_id`'s pending update (if any) has finished; re-raise its error."""
        event = self._done.get(layer_id)
        if event is None or event.is_set():
            return
        while not event.wait(0.05):
            if self._future is not None and self._future.done():
                break
        self.check()

    def check(self) -> None:
        """Re-raise the background update's exception, if it failed."""
        if self._future is not None and self._future.done() and self._future.exception() is not None:
            self.flush()  # raises the update's exception, once

    def flush(self) -> None:
        """Wait for every pending update."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            finally:
                self._done = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
