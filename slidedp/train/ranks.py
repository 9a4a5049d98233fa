"""`slidedp train` under torchrun: which process does what, and how the processes agree.

Launched by `torchrun --nnodes N --nproc-per-node G -m slidedp train CONFIG` (or `--standalone
--nproc-per-node G` on one host), every process is one rank of the engine (slidedp/api.py) and runs
the whole job: it loads the model and the data, compiles, and calls `step` with the same global
batch (the engine takes each rank's share of its rows), `evaluate` and checkpoints (collectives).
What is written once is written by rank 0 alone: the run folder's lock, `config.json`, `plan.json`,
`metrics.jsonl`, TensorBoard and trackers, the log lines, and every file of a checkpoint but the
hosts' layer files (each host's first rank writes its own: slidedp/run/checkpoint.py).

`Ranks` is this process's place (rank, host) and a gloo process group over every rank for the few
decisions the job makes together: an error on one rank raised on all (`together`), rank 0's
choices shared (`share`), a signal seen by any rank stopping all of them at the same step
(`any_signal`). Without torchrun (or with WORLD_SIZE=1) it is one rank and every call is local.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from slidedp.errors import WorkerError

WAIT_S = 4 * 3600  # how long a rank waits for the others in the job's own collectives (SLIDEDP_TRAIN_WAIT_S)

# Errors that mean bad input (the command line exits 2 for them; slidedp/cli.py)
INPUT_ERRORS = (ValueError, TypeError, LookupError, OSError, ImportError)


class RankRefused(ValueError):
    """Another rank refused its input (config, data, model, run folder): the message names it."""


def launched_world() -> tuple[int, int, int] | None:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE, RANK) when a launcher (torchrun) started this process, else None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        rank = int(os.environ.get("RANK", 0))
    except ValueError:
        raise ValueError(f"WORLD_SIZE, LOCAL_WORLD_SIZE and RANK must be integers (torchrun sets them), got "
                         f"{os.environ.get('WORLD_SIZE')!r}, {os.environ.get('LOCAL_WORLD_SIZE')!r}, "
                         f"{os.environ.get('RANK')!r}") from None
    return world, local, rank


def resolve_world_size(configured: int) -> int:
    """The run's world size: torchrun's WORLD_SIZE under torchrun (config key `world_size` 0, or the
    same number), else the config's (0: 1). A config that disagrees with the launch is refused."""
    launched = launched_world()
    if launched is None:
        return configured or 1
    world, local, _ = launched
    if configured not in (0, world):
        hosts = f"{world // local} host(s) x {local} rank(s)" if local >= 1 and world % local == 0 else "ranks"
        raise ValueError(f"config key 'world_size' is {configured}, but torchrun started WORLD_SIZE={world} processes "
                         f"({hosts}): under torchrun the world size is the launch's; drop world_size from the "
                         f"config (0, the default, takes torchrun's) or set world_size={world}")
    return world


def launched_hosts(world_size: int) -> int:
    """The hosts a launch of `world_size` ranks spans (WORLD_SIZE / LOCAL_WORLD_SIZE; 1 without torchrun)."""
    launched = launched_world()
    if launched is None or world_size == 1:
        return 1
    world, local, _ = launched
    if local < 1 or world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a whole number of hosts of LOCAL_WORLD_SIZE={local} ranks")
    return world // local


@dataclass
class Ranks:
    """This process's place among the ranks of the run (see the module's docstring)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group: object = field(default=None, repr=False)
    owns_default_group: bool = False

    @property
    def launched(self) -> bool:
        """Every rank is a process of its own (torchrun with WORLD_SIZE > 1)."""
        return self.world_size > 1 and self.group is not None

    @property
    def hosts(self) -> int:
        return self.world_size // self.local_world_size if self.launched else 1

    @property
    def host_index(self) -> int:
        return self.rank // self.local_world_size if self.launched else 0

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size if self.launched else 0

    @property
    def writer(self) -> bool:
        """Rank 0: writes what exists once (run folder files, metrics, logs)."""
        return self.rank == 0

    @property
    def leader(self) -> bool:
        """Its host's first rank."""
        return self.local_rank == 0

    def where(self, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        return f"rank {rank} (host {rank // self.local_world_size})" if self.launched else "this process"

    # -- collectives (local without torchrun) ------------------------------------------------

    def share(self, obj, src: int = 0):
        """Rank `src`'s picklable `obj` on every rank."""
        if not self.launched:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, obj) -> list:
        if not self.launched:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.launched:
            dist.barrier(group=self.group)

    def together(self, fn, *args, **kwargs):
        """`fn(...)` on every rank; when it raises on any rank, every rank raises: the failing rank
        its own error, the others one naming it (a `RankRefused` for bad input, else a `WorkerError`),
        so that no rank waits in a collective for one that has failed."""
        if not self.launched:
            return fn(*args, **kwargs)
        try:
            result, failure = fn(*args, **kwargs), None
        except BaseException as exc:
            result, failure = None, exc
        failed = self.all_gather(None if failure is None else (isinstance(failure, INPUT_ERRORS),
                                                               f"{type(failure).__name__}: {failure}"))
        if failure is not None:
            raise failure
        for rank, report in enumerate(failed):
            if report is not None:
                bad_input, text = report
                if bad_input:
                    raise RankRefused(f"{self.where(rank)} refused: {' '.join(text.split())}")
                raise WorkerError(rank, text)
        return result

    def in_turns(self, fn, *args, **kwargs):
        """`fn(...)` on every rank (as `together`), each host's first rank before the host's others:
        what it fills once per host (the tokenized-data cache, a converted model) the others read."""
        if not self.launched:
            return fn(*args, **kwargs)
        first = self.together(fn, *args, **kwargs) if self.leader else self.together(lambda: None)
        later = self.together(fn, *args, **kwargs) if not self.leader else self.together(lambda: None)
        return first if self.leader else later

    def any_signal(self, signum: int | None) -> int | None:
        """The signal any rank has received (the largest number), or None: every rank stops at the same step."""
        if not self.launched:
            return signum
        flag = torch.tensor([signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) or None

    def close(self) -> None:
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self.group, self.owns_default_group = None, False


def start_ranks(world_size: int, device: torch.device) -> Ranks:
    """This process's `Ranks` for a run of `world_size` ranks (resolve_world_size): under torchrun
    with several ranks it joins the default process group (gloo; gloo and NCCL on CUDA), which the
    engine's own groups then join; otherwise one local rank."""
    launched = launched_world()
    if launched is None or world_size == 1:
        return Ranks()
    launched_hosts(world_size)  # the layout checked
    world, local, rank = launched
    owns = not dist.is_initialized()
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % local)))
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                rank=rank, world_size=world, timeout=timedelta(seconds=600))
    # the job's own waits (a host tokenizing its data, rank 0 verifying a large checkpoint) may be long;
    # a rank that dies ends them at once (gloo sees its connection close)
    wait_s = float(os.environ.get("SLIDEDP_TRAIN_WAIT_S", str(WAIT_S)))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
    return Ranks(rank=rank, world_size=world, local_world_size=local, group=group, owns_default_group=owns)
