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
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


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
        if self.hosts > 1:
            G = self.local_world_size
            for h in range(self.hosts):  # every rank creates every group, in the same order
                group = dist.new_group(ranks=list(range(h * G, (h + 1) * G)), backend="gloo", timeout=timeout)
                if h == self.host_index:
                    self.node_group = group

    @property
    def leader(self) -> bool:
        """This rank is its host's first: it speaks for the host state between hosts."""
        return self.local_rank == 0

    def from_leader(self, obj):
        """This host's first rank's `obj`, on every rank of the host."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.host_index * self.local_world_size,
                                   group=self.node_group if self.hosts > 1 else self.host_group)
        return box[0]

    def broadcast_all_(self, tensor: torch.Tensor, src: int) -> None:
        """Every rank's CPU `tensor` <- rank `src`'s (over gloo: a host-state range)."""
        dist.broadcast(tensor, src, group=self.host_group)

    def share(self, obj, src: int = 0):
        """Rank `src`'s picklable `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        """Every rank's `tensor` <- rank `src`'s (weights of a chunk that rank copied from the host)."""
        dist.broadcast(tensor, src, group=self.deliver_group)

    def reduce_(self, tensor: torch.Tensor, dst: int) -> None:
        """Rank `dst`'s `tensor` <- the sum over ranks (a gradient chunk that rank owns)."""
        dist.reduce(tensor, dst, op=dist.ReduceOp.SUM, group=self.reduce_group)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Every rank's `tensor` <- the sum over ranks (the gradient of a layer whose optimizer state
        every rank keeps on its device)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.reduce_group)

    def all_reduce_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a small CPU tensor over the ranks, in place."""
        dist.all_reduce(tensor, group=self.host_group)
        return tensor

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    def close(self) -> None:
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
