"""A child process with a timeout, its output echoed, its record read back (or made from a fallback)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

def run_child(cmd: list[str], result: Path, timeout_s: float, fallback: dict) -> dict:
    """Run one point's child process, echoing its output, in its own process group (a timeout kills it and
    everything it started); its record from `result`, else `fallback` with the error and the tail
    of its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # its own process group: a timeout kills all of it
    tail: deque[str] = deque(maxlen=40)

    def pump():
        for line in proc.stdout:
            tail.append(line)
            sys.stderr.write(line)
        sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:  # Ctrl-C or a kill of the driver: the child, in its own process group, goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    reader.join(timeout=10)
    wall = time.perf_counter() - t0
    record = json.loads(result.read_text()) if result.exists() else None
    died_in_teardown = record is not None and record.get("teardown") == "not finished"  # after its measurement
    if died_in_teardown:
        record["teardown_error"] = _failure(timed_out, timeout_s, proc.returncode)
    elif record is None or timed_out:
        record = dict(fallback)
        record["error"] = _failure(timed_out, timeout_s, proc.returncode)
        record["output_tail"] = "".join(tail)[-4000:]
    record["child_wall_s"] = wall
    record["child_exit_code"] = proc.returncode
    return record


def _failure(timed_out: bool, timeout_s: float, returncode: int | None) -> str:
    """Why a child ended without finishing: timeout, signal or exit code."""
    if timed_out:
        return f"timeout after {timeout_s} s"
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode}" + (" (host out of memory?)" if returncode == -9 else "")
    return f"exit code {returncode} without a record"
