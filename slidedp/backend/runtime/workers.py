"""Worker processes of a multi-rank engine, one per rank, driven by a single controller.

The controller (the user's process, which holds `Engine`) creates the host state, then starts
`world_size` processes with the `spawn` method. Each receives, once, a pickled skeleton of the job
over its pipe: the model with its trainable parameters replaced by meta tensors (weights come from
the shared host state, never from the pickle), the layer graph, the plan and the program. It maps
the host state (`HostState.attach`), joins the process group (NCCL between GPUs, gloo between CPU
processes) and builds its executor and `Rank`. Then it serves commands: `step` (its rows of the
global batch), `flush` (finish pending updates), `reload` (host state rewritten by the controller,
e.g. from a checkpoint), `device_memory` (peak device memory, for benchmarks), `device_state_bytes`
(the bytes of the optimizer state the rank keeps on its device), `close`.

Failure: a worker that raises reports the error and exits; one that dies is seen through its
process sentinel. Either way the controller marks the failure in the shared flags (every waiting
rank raises), terminates the other workers, and raises `WorkerError` naming the rank. Workers also
die with the controller (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing as mp
import os
import time
import pickle
import shutil
import signal
import tempfile
import traceback
from multiprocessing import resource_sharer
from multiprocessing import util as mp_util
from multiprocessing.connection import wait as wait_any

import numpy as np
import torch
from torch import nn

from slidedp.backend.runtime.comm import RankComm
from slidedp.backend.runtime.rank import RankStep, build_rank
from slidedp.backend.state.host_state import HostState
from slidedp.backend.state.step_flags import StepFlags
from slidedp.errors import WorkerError  # noqa: F401 - raised here, re-exported


# -- the job skeleton ---------------------------------------------------------------------------
def _meta_parameter(shape, dtype, requires_grad):
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)


class _SkeletonPickler(pickle.Pickler):
    """Pickles trainable parameters as meta tensors of the same shape (their values live in the host state)."""

    def reducer_override(self, obj):
        if isinstance(obj, nn.Parameter) and obj.requires_grad:
            return _meta_parameter, (tuple(obj.shape), obj.dtype, True)
        return NotImplemented


def job_skeleton(**job) -> bytes:
    buf = io.BytesIO()
    _SkeletonPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(job)
    return buf.getvalue()


# -- the controller's side ----------------------------------------------------------------------
class WorkerPool:
    def __init__(self, *, world_size: int, skeleton: bytes, host, flags, start_timeout_s: float = 600.0):
        self.world_size, self.host, self.flags = world_size, host, flags
        self.last_duration_s = 0.0  # (engine.updates API) updates run in the workers
        self._tmp = tempfile.mkdtemp(prefix="slidedp-ranks-")
        ctx = mp.get_context("spawn")  # fork is unsafe with CUDA and with Numba's OpenMP pool
        self.conns, self.procs = [], []
        self._closed = False
        self.failed: str | None = None  # why the ranks stopped, after a rank's failure
        try:
            for r in range(world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"slidedp-rank{r}", daemon=True,
                                   args=(r, world_size, theirs, f"file://{self._tmp}/store", os.getpid()))
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
            for r in range(world_size):
                self._send(r, skeleton)
            self._gather(timeout_s=start_timeout_s)
            # The workers have their pipes: stop the thread that handed them over, so that it is not
            # caught in accept() when this process exits (it restarts if anything else needs it).
            resource_sharer.stop()
        except BaseException:
            self.close()
            raise

    def call(self, command: str, kwargs_per_rank: list[dict]) -> list:
        """Send `command` to every rank (its own keyword arguments) and collect the replies in rank order."""
        for r, kwargs in enumerate(kwargs_per_rank):
            self._send(r, (command, kwargs))
        return self._gather()

    def _send(self, rank: int, message) -> None:
        try:
            if isinstance(message, bytes):
                self.conns[rank].send_bytes(message)
            else:
                self.conns[rank].send(message)
        except OSError:  # the pipe is broken: the process is gone
            self._exited(rank)

    def _gather(self, timeout_s: float | None = None) -> list:
        replies: list = [None] * self.world_size
        waiting = set(range(self.world_size))
        waited = 0.0
        while waiting:
            handles = {self.conns[r]: r for r in waiting}
            handles.update({self.procs[r].sentinel: r for r in waiting})
            ready = wait_any(list(handles), timeout=1.0)
            if not ready:
                waited += 1.0
                if timeout_s is not None and waited > timeout_s:
                    self._fail(min(waiting), f"did not answer within {timeout_s:.0f} s")
                continue
            for handle in ready:
                r = handles[handle]
                if r not in waiting:
                    continue
                conn = self.conns[r]
                if handle is not conn and not conn.poll():
                    self._exited(r)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    self._exited(r)
                if kind == "error":
                    self._fail(*self._root_cause(r, value))
                replies[r] = value
                waiting.discard(r)
        return replies

    def _exited(self, rank: int):
        self.procs[rank].join(1.0)
        self._fail(rank, f"its process exited (exit code {self.procs[rank].exitcode})")

    def _root_cause(self, rank: int, detail: str, wait_s: float = 2.0) -> tuple[int, str]:
        """The rank to blame for `rank`'s error: an error in a collective is often the echo of another
        rank's process being killed, so a rank killed by a signal within `wait_s` is blamed instead."""
        deadline = time.monotonic() + wait_s
        while True:
            killed = [q for q in range(self.world_size) if q != rank and (self.procs[q].exitcode or 0) < 0]
            if killed:
                return killed[0], f"its process exited (exit code {self.procs[killed[0]].exitcode})"
            if time.monotonic() >= deadline:
                return rank, detail
            time.sleep(0.05)

    def _fail(self, rank: int, detail: str):
        self.failed = f"rank {rank} failed ({detail}) and every rank stopped, its step perhaps half taken"
        if self.flags is not None:
            self.flags.abort(rank)
        self.close(graceful=False)
        raise WorkerError(rank, detail)

    # -- the runner API the engine uses (the same as a local `Rank`) ------------------------------
    def step(self, input_ids, labels, attention_mask, global_tokens, **kw) -> RankStep:
        # numpy arrays pickle inline; a tensor would be shared through a file descriptor served by this
        # process's resource-sharer thread, which prints a traceback when a rank dies before taking it
        batch = dict(input_ids=_inline(input_ids), labels=_inline(labels), attention_mask=_inline(attention_mask),
                     global_tokens=global_tokens, **kw)
        replies = self.call("step", [batch] * self.world_size)  # each rank takes its share of the rows
        first = replies[0]
        if kw.get("optimizer") is not None and not first.skipped:
            self.host.step += 1  # the controller's count; each rank keeps its own
        return RankStep(first.loss, first.grad_norm, first.clip_coef, first.skipped,
                        wait_s=max(r.wait_s for r in replies), pass_s=max(r.pass_s for r in replies),
                        block_issue_s=max(r.block_issue_s for r in replies))

    def flush(self) -> None:
        if not self._closed:
            self.call("flush", [{}] * self.world_size)

    def sync_host(self) -> None:
        """Flush, and rank 0 copies the optimizer state kept on the devices into the shared host state."""
        if not self._closed:
            self.call("sync_host", [{}] * self.world_size)

    def reload(self, step: int) -> None:
        self.call("reload", [dict(step=step)] * self.world_size)

    def device_memory(self, reset: bool = False) -> list[dict | None]:
        """Each rank's peak device memory since its last reset, in rank order: {"max_allocated_bytes",
        "max_reserved_bytes"} (torch.cuda's counters; None on the CPU); `reset` starts new peaks."""
        return self.call("device_memory", [dict(reset=reset)] * self.world_size)

    def device_state_bytes(self) -> list[int]:
        """Bytes of the optimizer state each rank keeps on its device, in rank order."""
        return self.call("device_state_bytes", [{}] * self.world_size)

    def close(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(("close", {}))
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(30.0)
        for proc in self.procs:  # workers ignore SIGTERM (see _die_with_parent)
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


# -- the worker's side --------------------------------------------------------------------------
def _die_with_parent(controller_pid: int) -> None:
    """End this process when its parent ends (PR_SET_PDEATHSIG); the controller must be alive now.
    SIGINT and SIGTERM (a Ctrl-C reaches the whole process group) are the controller's to handle:
    it finishes the step, then closes the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # M_MMAP_THRESHOLD fixed at 1 MiB: large buffers a step frees go back to the system rather
        # than stay in glibc's heap (its threshold otherwise grows with them), so a rank's private
        # memory stays its working set.
        libc.mallopt(-3, 1 << 20)
        libc.mallopt(-8, 2)  # M_ARENA_MAX: the rank's many threads share two heaps
    except (OSError, AttributeError):
        pass
    try:
        os.kill(controller_pid, 0)
    except ProcessLookupError:  # the controller died before prctl took effect
        os._exit(1)


def worker_main(rank: int, world_size: int, conn, init_method: str, controller_pid: int) -> None:
    """A rank's process: build the rank from the skeleton, then serve the controller's commands."""
    _die_with_parent(controller_pid)
    flags = runner = host = None
    try:
        job = pickle.loads(conn.recv_bytes())
        model, device_type, handle = job.pop("model"), job.pop("device"), job.pop("host")
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        host = HostState.attach(handle)
        flags = StepFlags(host.control(), world_size, len(job["graph"].layers))
        comm = RankComm(rank, world_size, device, init_method=init_method)
        if device.type == "cuda":
            host.pin()
        runner = build_rank(model=model, host=host, device=device, rank=rank, world_size=world_size, comm=comm,
                            flags=flags, **job)
        conn.send(("ok", None))
        while True:
            command, kwargs = conn.recv()
            if command == "close":
                break
            if command == "step":
                reply = runner.step(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                       for k, v in kwargs.items()})
            elif command == "flush":
                reply = runner.flush()
            elif command == "sync_host":
                reply = runner.sync_host()
            elif command == "reload":
                reply = runner.reload(kwargs["step"])
            elif command == "device_memory":
                reply = _device_memory(device, kwargs["reset"])
            elif command == "device_state_bytes":
                reply = runner.device_state.nbytes if runner.device_state is not None else 0
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
    except BaseException as e:  # noqa: BLE001 - reported to the controller, then this process ends
        if flags is not None:
            flags.abort(rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}"))
        except OSError:
            pass
        _exit(1)
    try:
        runner.close()
        host.close()
    finally:
        _exit(0)


def _exit(code: int) -> None:
    """End a rank's process without waiting on its threads (Numba's pool, the comm's), after running
    the finalizers that unlink and unregister what multiprocessing made here (the lock tqdm takes when
    inductor compiles blocks): otherwise the resource tracker warns of leaked semaphores at exit."""
    try:
        mp_util._run_finalizers(0)
    finally:
        os._exit(code)


def _device_memory(device: torch.device, reset: bool) -> dict | None:
    if device.type != "cuda":
        return None
    peaks = {"max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
             "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peaks


def _inline(tensor):
    """A CPU tensor as a numpy array (None stays None), to be pickled with its data."""
    return None if tensor is None else tensor.numpy()
