"""Collectives among the ranks: NCCL between GPUs, gloo between CPU processes.

Two device groups let weight delivery (broadcasts on the H2D stream) and gradient reduction
(reduces on the D2H stream) proceed independently; a gloo group carries the few host scalars of a
step (loss, sum of squares) and barriers. The same calls run on CPU (gloo everywhere), which is
how CI tests the multi-rank code path.

Several hosts (`local_world_size` < `world_size`; torchrun numbers the ranks of host h from
h * local_world_size): each host's ranks share that host's state; a gloo group per host carries its
host state's handle; each host holds only its share of the state (backend/state/host_state.py), and
what a caller needs whole (`Engine.state_dict`, exports) is broadcast to every rank over the gloo
group of all ranks, a run of chunks at a time.

A lost host (several hosts): every rank runs a `HostWatch`, a thread that bumps its host's counter
in the launcher's rendezvous store (a client of its own, MASTER_ADDR:MASTER_PORT) and follows the
other hosts' counters. A collective that fails (gloo reports the peer's closed connection at once)
becomes a `HostLostError` naming the host whose counter stopped (its GROUP_RANK and hostname), or
host 0 when the store itself stops answering (torchrun's static rendezvous serves it from host 0's
launcher). A rank stuck in a collective with a host lost for longer than SLIDEDP_HOST_TIMEOUT_S
(default 60 s) writes that error and exits (the launcher then stops the host's other ranks).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from slidedp.errors import HostLostError

BEAT_S = 0.25  # how often a host's counter is bumped
LOST_AFTER_S = 2.0  # a host whose counter did not move for this long is lost


class HostWatch:
    """Liveness of the hosts through the rendezvous store (see the module's docstring)."""

    def __init__(self, host: int, hosts: int, names: list[str], *, addr: str, port: int,
                 timeout_s: float, beat_s: float = BEAT_S, lost_after_s: float = LOST_AFTER_S):
        self.host, self.hosts, self.names = host, hosts, names
        self.beat_s, self.lost_after_s, self.timeout_s = beat_s, lost_after_s, timeout_s
        self.store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(2 * beat_s, 1.0)),
                                   wait_for_workers=False)
        now = time.monotonic()
        self.seen = {h: (-1, now) for h in range(hosts) if h != host}  # counter, when it last moved
        self.store_lost_since: float | None = None
        self.in_collective_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slidedp-host-watch", daemon=True)
        self._thread.start()

    def _key(self, h: int) -> str:
        return f"slidedp/host-beat/{h}"

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            now = time.monotonic()
            try:
                self.store.add(self._key(self.host), 1)
                for h, (count, since) in self.seen.items():
                    value = self.store.add(self._key(h), 0)
                    if value != count:
                        self.seen[h] = (value, now)
                self.store_lost_since = None
            except Exception:  # noqa: BLE001 - the store is gone or does not answer
                if self.store_lost_since is None:
                    self.store_lost_since = now
            stuck = self.in_collective_since
            lost = self.lost()
            if lost and stuck is not None and now - stuck > self.timeout_s:
                sys.stderr.write(f"slidedp: {self.describe(lost)}; this rank waited {now - stuck:.0f} s in a "
                                 "collective and exits\n")
                sys.stderr.flush()
                os._exit(1)

    def lost(self) -> list[int]:
        """The hosts taken for lost now: their counter stood still for `lost_after_s`; host 0 when
        the store has not answered for that long."""
        now = time.monotonic()
        out = [h for h, (_, since) in self.seen.items() if now - since > self.lost_after_s]
        if not out and self.store_lost_since is not None and now - self.store_lost_since > self.lost_after_s \
                and self.host != 0:
            out = [0]
        return out

    def describe(self, lost: list[int]) -> str:
        return "; ".join(f"host {h} (GROUP_RANK {h}, hostname {self.names[h]}) stopped: its processes no longer "
                         "answer" for h in lost)

    def wait_lost(self) -> list[int]:
        """The lost hosts, waiting up to `lost_after_s` plus two beats for the evidence."""
        deadline = time.monotonic() + self.lost_after_s + 2 * self.beat_s
        while True:
            lost = self.lost()
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(self.beat_s / 2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.beat_s)


class RankComm:
    def __init__(self, rank: int, world_size: int, device: torch.device, *, init_method: str | None = None,
                 timeout_s: float = 600.0, local_world_size: int | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.local_world_size = local_world_size or world_size
        if world_size % self.local_world_size:
            raise ValueError(f"world_size {world_size} is not a multiple of the ranks per host {self.local_world_size}")
        self.hosts = world_size // self.local_world_size
        self.host_index, self.local_rank = divmod(rank, self.local_world_size)
        self.owns_default_group = not dist.is_initialized()
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if self.owns_default_group:
            kwargs = dict(device_id=device) if device.type == "cuda" else {}
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout, **kwargs)
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"torch.distributed is initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"not rank {rank} of {world_size}")
        self.deliver_group = dist.new_group(backend=backend, timeout=timeout)
        self.reduce_group = dist.new_group(backend=backend, timeout=timeout)
        self.host_group = dist.new_group(backend="gloo", timeout=timeout)
        self.node_group = None  # several hosts only
        self.watch: HostWatch | None = None
        self.host_names: list[str] = [socket.gethostname()]
        if self.hosts > 1:
            G = self.local_world_size
            for h in range(self.hosts):  # every rank creates every group, in the same order
                group = dist.new_group(ranks=list(range(h * G, (h + 1) * G)), backend="gloo", timeout=timeout)
                if h == self.host_index:
                    self.node_group = group
            names = [None] * world_size
            dist.all_gather_object(names, socket.gethostname(), group=self.host_group)
            self.host_names = names[::G]
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if addr and port:
                self.watch = HostWatch(self.host_index, self.hosts, self.host_names, addr=addr, port=int(port),
                                       timeout_s=float(os.environ.get("SLIDEDP_HOST_TIMEOUT_S", "60")))

    @contextmanager
    def _guard(self):
        """A collective: its failure with another host lost becomes a HostLostError naming the host."""
        watch = self.watch
        if watch is None:
            yield
            return
        watch.in_collective_since = time.monotonic()
        try:
            yield
        except Exception as exc:
            lost = watch.wait_lost()
            if not lost:
                raise
            raise HostLostError(f"{watch.describe(lost)} (rank {self.rank} on host {self.host_index}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]})", host=lost[0]) from exc
        finally:
            watch.in_collective_since = None

    @property
    def leader(self) -> bool:
        """This rank is its host's first: it speaks for the host state between hosts."""
        return self.local_rank == 0

    def from_leader(self, obj):
        """This host's first rank's `obj`, on every rank of the host."""
        box = [obj]
        with self._guard():
            dist.broadcast_object_list(box, src=self.host_index * self.local_world_size,
                                       group=self.node_group if self.hosts > 1 else self.host_group)
        return box[0]

    def broadcast_all_(self, tensor: torch.Tensor, src: int) -> None:
        """Every rank's CPU `tensor` <- rank `src`'s (over gloo: a host-state range)."""
        with self._guard():
            dist.broadcast(tensor, src, group=self.host_group)

    def share(self, obj, src: int = 0):
        """Rank `src`'s picklable `obj` on every rank."""
        box = [obj]
        with self._guard():
            dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        out = [None] * self.world_size
        with self._guard():
            dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        """Every rank's `tensor` <- rank `src`'s (weights of a chunk that rank copied from the host)."""
        with self._guard():
            dist.broadcast(tensor, src, group=self.deliver_group)

    def reduce_(self, tensor: torch.Tensor, dst: int) -> None:
        """Rank `dst`'s `tensor` <- the sum over ranks (a gradient chunk that rank owns)."""
        with self._guard():
            dist.reduce(tensor, dst, op=dist.ReduceOp.SUM, group=self.reduce_group)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Every rank's `tensor` <- the sum over ranks (the gradient of a layer whose optimizer state
        every rank keeps on its device)."""
        with self._guard():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.reduce_group)

    def all_reduce_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a small CPU tensor over the ranks, in place."""
        with self._guard():
            dist.all_reduce(tensor, group=self.host_group)
        return tensor

    def barrier(self) -> None:
        with self._guard():
            dist.barrier(group=self.host_group)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
