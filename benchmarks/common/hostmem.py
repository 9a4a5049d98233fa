"""Host memory: the machine's used memory sampled in a thread, this process's /proc status, the peak
RSS reset, and the proportional set size of a process tree (ranks and their workers)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

# -- host memory ----------------------------------------------------------------------------------------

def _meminfo_used() -> int:
    vals = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                vals[key] = int(rest.split()[0]) * 1024
    return vals["MemTotal"] - vals["MemAvailable"]


def proc_status() -> dict[str, int]:
    """Memory lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_vm_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class HostMemSampler:
    """Peak of the machine's used memory (MemTotal - MemAvailable) above its value at start."""

    def __init__(self, period_s: float = 0.05):
        self.base = _meminfo_used()
        self.peak_all = self.peak_window = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s):
        while not self._stop.wait(period_s):
            self.sample()

    def sample(self):
        used = _meminfo_used()
        self.peak_all = max(self.peak_all, used)
        self.peak_window = max(self.peak_window, used)

    def reset_window(self):
        self.sample()
        self.peak_window = _meminfo_used()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.sample()


def smaps_bytes(pid: int, key: str = "Pss") -> int:
    """A field of /proc/PID/smaps_rollup, in bytes (Pss; Anonymous: private heap and stacks)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# -- a process tree: a point's ranks and every process they started ------------------------------------------------------

def process_tree(root: int) -> list[int]:
    """`root` and every process descending from it (from /proc/PID/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_pss_bytes(root: int) -> dict[int, int]:
    """PSS of `root` and its descendants, by pid (processes gone meanwhile are left out)."""
    out = {}
    for pid in process_tree(root):
        with contextlib.suppress(OSError, ValueError):
            out[pid] = smaps_bytes(pid, "Pss")
    return out


class TreeSampler(HostMemSampler):
    """HostMemSampler (the machine's used memory every 50 ms), plus the summed PSS of this process and
    every process it started: every `pss_period_s` in the background (reading smaps_rollup walks
    the page tables of every mapping, too slow for 50 ms with a 100 GiB host state) and on each sample()
    from another thread (the ends of the measured window)."""

    def __init__(self, period_s: float = 0.05, pss_period_s: float = 1.0):
        self._lock = threading.Lock()
        self.pss_period_s, self._pss_due = pss_period_s, 0.0
        self.pss_peak_all = self.pss_peak_window = 0
        self.pss_last: dict[int, int] = {}
        self.pss_at_window_peak: dict[int, int] = {}  # by process, when the window's peak was sampled
        super().__init__(period_s)

    def sample(self):
        super().sample()
        now = time.monotonic()
        if threading.current_thread() is getattr(self, "_thread", None) and now < self._pss_due:
            return
        self._pss_due = now + self.pss_period_s
        per_process = tree_pss_bytes(os.getpid())
        total = sum(per_process.values())
        with self._lock:
            self.pss_last = per_process
            self.pss_peak_all = max(self.pss_peak_all, total)
            if total >= self.pss_peak_window:
                self.pss_peak_window, self.pss_at_window_peak = total, per_process

    def reset_window(self):
        super().reset_window()  # samples (PSS included) first
        with self._lock:
            self.pss_peak_window, self.pss_at_window_peak = sum(self.pss_last.values()), self.pss_last
