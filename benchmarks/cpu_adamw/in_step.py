"""The CPU AdamW's rate in the conditions of a training step, one condition added at a time.

`slidedp calibrate` times the AdamW on NumPy arrays, on every core, with the copies it measures beside
it queued in advance and the calling thread otherwise idle. A rank's round of updates runs on the
update thread with one core fewer (backend/runtime/rank.py `update_threads`), over the host state (one
memfd shared file, backend/state/host_state.py), while the main thread issues and waits for the
device's work and the copies go both ways. Each row below adds one of those conditions; the rate is the
median of --repeats AdamW steps over --params parameters (bf16 gradient in, bf16 weights out), timed on
the thread that runs them. The last rows are `slidedp calibrate`'s own contended measurements (the
fractions of its profile), taken as it takes them.

    python benchmarks/cpu_adamw/in_step.py [--params 256M] [--repeats 7] [--out results/DATE-WHAT.json]
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.records import add_allow_dirty, commit_stamp, write_records  # noqa: E402
from benchmarks.cpu_adamw.run import parse_count  # noqa: E402

from slidedp.backend.kernels.cpu_adamw import adamw_step  # noqa: E402
from slidedp.profiler import calibrate as cal  # noqa: E402

DTYPES = (np.float32, np.uint16, np.float32, np.float32, np.uint16)  # master, grad, exp_avg, exp_avg_sq, bf16 out


class State:
    """The arrays of one AdamW over `numel` parameters, in NumPy's memory or in one memfd file."""

    def __init__(self, numel: int, memfd: bool):
        self.numel, self.memfd, self.registered = numel, memfd, None
        sizes = [numel * np.dtype(d).itemsize for d in DTYPES]
        if memfd:
            page = mmap.PAGESIZE
            offsets, total = [], 0
            for s in sizes:
                offsets.append(total)
                total += -(-s // page) * page
            self.fd = os.memfd_create("in-step", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, total)
            self.map = mmap.mmap(self.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.arrays = [np.frombuffer(self.map, dtype=d, count=numel, offset=o) for d, o in zip(DTYPES, offsets)]
            self.nbytes = total
        else:
            self.arrays = [np.empty(numel, dtype=d) for d in DTYPES]
        for a, value in zip(self.arrays, (0.02, 0x3C23, 0.0, 0.0, 0)):
            a[:] = value

    def register(self) -> None:
        """Pin the memfd file for DMA, as HostState.pin does."""
        ptr = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({int(err)})")
        self.registered = ptr

    def master_as_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.arrays[0])

    def step(self, threads: int) -> None:
        p, g, m, v, out = self.arrays
        adamw_step(p, g, m, v, out, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1,
                   num_threads=threads)


def adamw_rate(state: State, threads: int, repeats: int) -> float:
    """Parameters per second of the AdamW on `threads` threads, run and timed on a thread of its own."""
    times: list[float] = []

    def work() -> None:
        state.step(threads)  # compiled or loaded from the cache outside the timings
        for _ in range(repeats):
            t0 = time.perf_counter()
            state.step(threads)
            times.append(time.perf_counter() - t0)

    worker = threading.Thread(target=work, name="in-step-adamw")
    worker.start()
    worker.join()
    return state.numel / statistics.median(times)


class Copies:
    """Copies both ways on two streams, requeued until told to stop (pinned buffers, or a registered
    host array as the source of the H2D and the destination of the D2H); counts the bytes moved."""

    def __init__(self, nbytes: int, host: torch.Tensor | None = None):
        self.host_src = host if host is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_dst = host if host is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        n = self.host_src.numel()
        self.dev_src = torch.empty(n, dtype=self.host_src.dtype, device="cuda")
        self.dev_dst = torch.empty(n, dtype=self.host_src.dtype, device="cuda")
        self.up, self.down = torch.cuda.Stream(), torch.cuda.Stream()
        self.bytes_moved = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with torch.cuda.stream(self.up):
                self.dev_dst.copy_(self.host_src, non_blocking=True)
            with torch.cuda.stream(self.down):
                self.host_dst.copy_(self.dev_src, non_blocking=True)
            self.bytes_moved += 2 * self.host_src.numel() * self.host_src.element_size()
            self.up.synchronize()
            self.down.synchronize()


def main_thread_busy(stop: threading.Event) -> None:
    """The main thread's part in a step: device work queued, then waited for (torch.cuda.synchronize)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()


def measure(state: State, threads: int, repeats: int, *, copies: Copies | None = None, busy_main: bool = False) -> dict:
    """The AdamW's rate (`adamw_rate`) with the copies running and the main thread busy, as asked."""
    def timed() -> tuple[float, float]:
        if copies is not None:
            copies.bytes_moved = 0  # counted from here (give or take the pair under way)
        t0 = time.perf_counter()
        return adamw_rate(state, threads, repeats), time.perf_counter() - t0

    run = timed
    helpers = ([(main_thread_busy, "in-step-main")] if busy_main else []) + \
        ([(copies.run, "in-step-copies")] if copies is not None else [])
    for loop, name in helpers:  # each runs on a thread of its own while the ones inside it and the AdamW run
        run = functools.partial(cal.beside, loop, run, name=name, settle_s=0.2)
    rate, wall = run()
    out = {"params_per_s": rate}
    if copies is not None:
        out["copies_bytes_per_s"] = copies.bytes_moved / wall
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_count, default=parse_count("256M"), help="parameters (default 256M)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    add_allow_dirty(p)
    args = p.parse_args()
    stamp = commit_stamp(args.allow_dirty)
    numel = args.params
    cores = os.cpu_count() or 2
    cuda = torch.cuda.is_available()
    plain, shared = State(numel, memfd=False), State(numel, memfd=True)
    rows = []

    def row(what: str, **kw) -> None:
        r = {"condition": what, **kw}
        rows.append(r)
        extra = f", copies {r['copies_bytes_per_s'] / 1e9:.1f} GB/s" if "copies_bytes_per_s" in r else ""
        print(f"{what:<75} {r['params_per_s'] / 1e9:6.3f} G params/s{extra}", flush=True)

    row(f"NumPy arrays, {cores} threads (as calibrate)", threads=cores, **measure(plain, cores, args.repeats))
    row(f"NumPy arrays, {cores - 1} threads (the update thread's)", threads=cores - 1,
        **measure(plain, cores - 1, args.repeats))
    row(f"memfd file (the host state), {cores - 1} threads", threads=cores - 1,
        **measure(shared, cores - 1, args.repeats))
    if cuda:
        pinned = Copies(1 << 30)
        row(f"memfd, {cores - 1} threads, copies both ways (pinned buffers)", threads=cores - 1,
            **measure(shared, cores - 1, args.repeats, copies=pinned))
        row(f"memfd, {cores - 1} threads, copies both ways, main thread queues and waits for the device",
            threads=cores - 1, **measure(shared, cores - 1, args.repeats, copies=pinned, busy_main=True))
        row(f"NumPy arrays, {cores} threads, copies both ways (as calibrate)", threads=cores,
            **measure(plain, cores, args.repeats, copies=pinned))
        del pinned
        other = State(numel, memfd=True)  # a second file: the state the copies read and write
        other.register()
        own = Copies(0, host=other.master_as_tensor())
        row(f"memfd, {cores - 1} threads, copies both ways of another registered memfd state (streamed updates)",
            threads=cores - 1, **measure(shared, cores - 1, args.repeats, copies=own, busy_main=True))
        del own, other
        # what `slidedp calibrate` measures now, as it measures it: its AdamW state and copy buffers
        state, buffers = cal.AdamwState(numel), cal.CopyBuffers(torch.device("cuda"), 1 << 30)
        alone = state.numel / cal.measure_adamw_s(state, [cores], repeats=args.repeats)[0][1]
        for out_of_place, field in ((False, "cpu_adamw_contended_fraction"), (True, "cpu_adamw_backward_fraction")):
            state.step(cores, out_of_place=out_of_place)
            rate = state.numel / cal.measure_adamw_contended_s(state, cores, buffers, repeats=args.repeats,
                                                               out_of_place=out_of_place)
            row(f"calibrate's measurement of {field}, {cores} threads: fraction {rate / alone:.3f}",
                threads=cores, field=field, fraction=rate / alone, alone_params_per_s=alone, params_per_s=rate)
    record = {**stamp, "command": "python " + " ".join(sys.argv), "params": numel, "cores": cores,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}
    if args.out:
        write_records(args.out, record)


if __name__ == "__main__":
    main()
