"""slidedp's logger ("slidedp"), and warnings given once per process.

A fallback (a preset guessed for an unknown GPU, a PyTorch reference run instead of a Triton kernel,
the module structure standing in for torch.export) is never silent: it is logged at WARNING, once
per distinct case (`key`), with the reason. Expected branches (a CPU tensor taking its reference,
an older transformers without a hook) stay quiet.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

log = logging.getLogger("slidedp")

_warned: set[tuple] = set()  # keys already warned about in this process (tests reset it)


def warn_once(key: tuple, message: str, *args) -> bool:
    """Log `message % args` at WARNING on the "slidedp" logger the first time `key` is seen; True then."""
    if key in _warned:
        return False
    _warned.add(key)
    log.warning(message, *args)
    return True


@contextmanager
def timed(phase: str):
    """Log at INFO how long a phase of a long job took ("slidedp: <phase>: 12.3 s"), once it ends; the
    record carries `phase` and `seconds` (a caller's handler can collect them: benchmarks do)."""
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    log.info("slidedp: %s: %.1f s", phase, seconds, extra={"phase": phase, "seconds": seconds})
