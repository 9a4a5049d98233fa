"""Collectives among the ranks of one host: NCCL between GPUs, gloo between CPU processes.

Two device groups let weight delivery (broadcasts on the H2D stream) and gradient reduction
(reduces on the D2H stream) proceed independently; a gloo group carries the few host scalars of a
step (loss, sum of squares) and barriers. The same calls run on CPU (gloo everywhere), which is
how CI tests the multi-rank code path.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class RankComm:
    def __init__(self, rank: int, world_size: int, device: torch.device, *, init_method: str | None = None,
                 timeout_s: float = 600.0):
        self.rank, self.world_size, self.device = rank, world_size, device
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
