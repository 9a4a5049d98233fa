"""Measure the link between hosts (`slidedp calibrate --link`, run under `torchrun --nnodes N`).

Every rank of every host all-gathers a buffer over torch.distributed (NCCL on CUDA, gloo on the
CPU), as the sharded route's collectives do. With the cost model's collective across hosts
(costmodel/ops.py: each host receives the (hosts - 1) / hosts of the buffer the others own over its
link, and the slower of that and the ring inside the host sets the time), the median time of the
all-gather gives the rate of each host's link: (hosts - 1) / hosts * nbytes / seconds
(`link_rate_bytes_per_s`). The result, a JSON of `link_bytes_per_s` and how it was measured, is what
`slidedp plan --link FILE` takes (and `slidedp.plan(..., link=load_link(FILE))`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slidedp.costmodel.hardware import load_link  # noqa: F401 - its home is the cost model

MiB = 2**20


def link_rate_bytes_per_s(nbytes: int, seconds: float, hosts: int) -> float:
    """The link rate [bytes/s] with which an all-gather of `nbytes` across `hosts` hosts takes
    `seconds`: the inverse of costmodel.ops' between-hosts term."""
    if hosts < 2 or nbytes <= 0 or not seconds > 0:
        raise ValueError(f"a link rate needs hosts >= 2, nbytes > 0 and seconds > 0, got {hosts}, {nbytes}, "
                         f"{seconds}")
    return (hosts - 1) / hosts * nbytes / seconds


def torchrun_hosts() -> tuple[int, int]:
    """(hosts, ranks per host) from torchrun's environment (WORLD_SIZE, LOCAL_WORLD_SIZE); a clear
    error where it is missing or names one host."""
    try:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise RuntimeError("slidedp calibrate --link measures the link between hosts: run it on every host "
                           "under torchrun --nnodes N (N >= 2), which sets WORLD_SIZE and LOCAL_WORLD_SIZE") from None
    if local < 1 or world % local or world // local < 2:
        raise RuntimeError(f"slidedp calibrate --link needs at least 2 hosts (torchrun --nnodes >= 2); "
                           f"WORLD_SIZE {world} and LOCAL_WORLD_SIZE {local} make {world // max(local, 1)}")
    return world // local, local


def measure_link(nbytes: int = 256 * MiB, *, repeats: int = 10, warmup: int = 2) -> dict:
    """All-gather `nbytes` (nbytes / world_size from each rank) `repeats` times after `warmup`, every
    rank of every host (initialises the default process group if needed); returns, on every rank,
    the median and spread of the times and the link rate they give."""
    hosts, per_host = torchrun_hosts()
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shard = max(1, nbytes // world)
    mine = torch.ones(shard, dtype=torch.uint8, device=device)
    out = torch.empty(shard * world, dtype=torch.uint8, device=device)
    times_s = []
    for i in range(warmup + repeats):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, mine)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times_s.append(time.perf_counter() - t0)
    slowest = torch.tensor(times_s, dtype=torch.float64)  # every rank's times: the collective ends at the slowest
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times_s = slowest.tolist()
    median = statistics.median(times_s)
    q = statistics.quantiles(times_s, n=4) if len(times_s) > 1 else [median, median, median]
    total = shard * world
    return {"link_bytes_per_s": link_rate_bytes_per_s(total, median, hosts), "hosts": hosts,
            "ranks_per_host": per_host, "nbytes": total, "median_s": median, "iqr_s": q[2] - q[0],
            "repeats": repeats, "backend": dist.get_backend(), "device": device.type}
