"""One data-parallel rank's step: passes over its rows, the reduced gradient, and its updates.

The same code runs the single-process engine (one rank, no collectives) and each worker process
of a multi-rank engine (backend/runtime/workers.py). A step:

  1. this rank's rows, in micro-batches, run in passes over the weights (executor.run_pass); each
     layer's gradient reaches the host by its route (routes.py), the loss is token-weighted by the
     *global* number of labelled tokens, so the sum over ranks is the loss of the global batch;
  2. the loss and each rank's share of the gradient's sum of squares are summed over the ranks:
     every rank gets the same norm, clip coefficient and finite check;
  3. if finite, this rank's CPU threads start AdamW on the chunks it owns, layer by layer in update
     order, in the background (update_stream.py) -- or, with early updates (one rank, no clipping:
     early_updates.py), they started with the last pass, each as its gradient landed, and are now
     kept (or taken back if the gradient is not finite; written in place, with nonfinite="stop", they
     cannot be: NonFiniteGradientError, the state part-updated); the next step's loads wait for each layer's
     update on every rank (routes.wait_updated). Layers whose optimizer state lives on the device
     (device_state.py) are updated there instead, on a stream of their own, before any later copy
     (the copy streams wait for it by an event): sharded by chunk owner, each rank its own chunks,
     and each writes them back to the shared host state when it is read; else every rank keeps the
     same copy, applies the same update, and the host's first rank writes it back. Layers whose
     update is streamed (streamed_updates.py) make a round trip through the device, each rank's
     chunks through its own. With streamed gradients (no clipping, one pass; several ranks: the GPU
     reduction) every host layer was updated in place as each piece of its gradient landed, each
     rank its own chunks (`_stream_gradients`); a non-finite one cannot be taken back and raises
     NonFiniteGradientError, the state part-updated.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from slidedp.backend.kernels import cpu_adamw
from slidedp.backend.runtime import allocator
from slidedp.backend.state.device_state import DeviceState
from slidedp.backend.runtime.early_updates import EarlyUpdates
from slidedp.backend.runtime.executor import StreamedExecutor
from slidedp.backend.runtime.pass_state import MicroBatch
from slidedp.backend.state.host_state import HostState
from slidedp.backend.runtime.routes import Routes
from slidedp.backend.runtime.streamed_updates import StreamedUpdates
from slidedp.backend.runtime.update_stream import UpdateStream
from slidedp.errors import NonFiniteGradientError
from slidedp.ir.graph import LayerGraph
from slidedp.optim import AdamW


@dataclass(frozen=True)
class RankStep:
    loss: float  # token-weighted mean over the global batch
    grad_norm: float  # of the whole global gradient, before clipping
    clip_coef: float
    skipped: bool  # non-finite gradient: nothing was updated
    wait_s: float  # this rank's wait for the previous step's updates
    pass_s: float  # this rank's passes, reduction and norm
    block_issue_s: float = 0.0  # of pass_s, the host's time issuing the blocks' forwards and backwards


class Rank:
    def __init__(self, *, executor: StreamedExecutor, host: HostState, graph: LayerGraph, update_order: list[int],
                 rank: int = 0, comm=None, flags=None, num_threads: int | None = None,
                 device_state: DeviceState | None = None, early_order=(), on_swap=lambda layer_ids: None,
                 streamed: StreamedUpdates | None = None, early_in_place: bool = False):
        self.executor, self.host, self.graph = executor, host, graph
        self.routes: Routes = executor.routes
        self.rank, self.comm, self.flags = rank, comm, flags
        self.world_size = comm.world_size if comm is not None else 1
        self.leader = comm is None or comm.leader  # this host's first rank (its state's writer)
        self.device_state = device_state
        self.routes.device_state = device_state
        self.streamed = streamed
        self.routes.streamed = streamed
        off_cpu = set(device_state.layers if device_state is not None else ()) | set(streamed.order if streamed else ())
        off_cpu |= self.routes.grads_streamed  # updated as their gradient lands (_stream_gradients)
        self.updates = UpdateStream(order=[i for i in update_order if i not in off_cpu], num_threads=num_threads)
        if flags is None:
            self.routes.wait_local_update = self.updates.wait
        else:
            flags.on_wait = self.updates.check
        if early_order and not self.routes.grads_streamed and (comm is not None or flags is not None):
            raise ValueError("early updates run on one rank in the engine's process only")
        self.early = (EarlyUpdates(host, list(early_order), self.updates, on_swap, in_place=early_in_place)
                      if early_order and not self.routes.grads_streamed else None)
        self._segments: dict[bool, list] = {}
        # (error class, why) once the state is that of a step part-applied (streamed gradients): steps refused
        self.broken: tuple[type, str] | None = None

    # -- the step -------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
             global_tokens: int, *, batch_size: int, micro_batches: int, optimizer: AdamW | None,
             max_grad_norm: float | None) -> RankStep:
        """A step on the global batch (CPU tensors; this rank takes its share of the rows);
        `optimizer=None` evaluates (no update)."""
        if self.broken is not None:
            error, why = self.broken
            raise error(f"{why}; load a checkpoint before the next step")
        t0, issued = time.perf_counter(), sum(self.executor.block_issue_s.values())
        share = input_ids.shape[0] // self.world_size
        rows = slice(self.rank * share, (self.rank + 1) * share)
        input_ids, labels = input_ids[rows], labels[rows]
        attention_mask = None if attention_mask is None else attention_mask[rows]
        mbs = [
            MicroBatch(input_ids[r : r + batch_size].to(self.executor.device, non_blocking=True),
                       labels[r : r + batch_size].to(self.executor.device, non_blocking=True),
                       None if attention_mask is None else attention_mask[r : r + batch_size].to(self.executor.device))
            for r in range(0, input_ids.shape[0], batch_size)
        ]
        passes = [mbs[i : i + micro_batches] for i in range(0, len(mbs), micro_batches)]
        streaming = bool(self.routes.grads_streamed) and optimizer is not None
        if streaming and len(passes) > 1:
            raise ValueError(f"the plan streams every gradient into its update (streamed_gradients): one pass per "
                             f"step, at most {micro_batches * batch_size} rows per rank, got {len(mbs) * batch_size}")
        if streaming and max_grad_norm is not None:
            raise ValueError("the plan streams every gradient into its update (streamed_gradients): no clipping")
        self.routes.wait_s = 0.0
        self.updates.gate()  # this step's loads wait for the rounds started before it
        early = self.early is not None and optimizer is not None and max_grad_norm is None
        loss = torch.zeros((), dtype=torch.float64)
        nonfinite = self._stream_gradients(optimizer) if streaming else None
        try:
            for k, group in enumerate(passes):
                last = k == len(passes) - 1
                if early and last:
                    self._start_early(optimizer)
                self.routes.begin_pass(first=k == 0, last=last)
                loss += self.executor.run_pass(group, global_tokens).double().cpu()
                self.routes.end_pass()
            sumsq = self.routes.finish(len(passes))
        except BaseException as exc:
            written = self._take_back() if early else []
            if written:  # early updates in place: those layers keep this step's update
                self.broken = (RuntimeError, f"step {self.host.step} failed ({type(exc).__name__}: {exc}) after its "
                               f"early updates had written layers {sorted(written)} in place: the state is that "
                               "of a step part-applied")
            if streaming:  # some layers may have been updated in place already
                self.broken = (RuntimeError, f"step {self.host.step + 1} failed ({type(exc).__name__}: {exc}) while "
                               "its gradients were streaming into the update: the state may be that of a step "
                               "part-applied")
            raise
        finally:
            self.routes.early = None
            self.routes.apply_gradient = None
        totals = torch.stack([loss, sumsq])
        if self.comm is not None:
            self.comm.all_reduce_host(totals)
        loss_value, norm = float(totals[0]), math.sqrt(float(totals[1]))
        timing = dict(wait_s=self.routes.wait_s, pass_s=time.perf_counter() - t0,
                      block_issue_s=sum(self.executor.block_issue_s.values()) - issued)
        if streaming and (nonfinite or not math.isfinite(norm)):
            self.host.step += 1  # the step the applied chunks counted in their bias correction
            self.routes.rounds += 1
            self.executor.resident_stale.update(self.executor.resident_ids)
            where = f"in layers {sorted(set(nonfinite))} " if nonfinite else ""
            self.broken = (NonFiniteGradientError, (
                f"step {self.host.step}: the gradient is not finite {where}(norm {norm}); with streamed gradients "
                "the other layers were already updated in place, so the state is that of a step part-applied (the "
                "non-finite chunks were not applied)"))
            raise NonFiniteGradientError(f"{self.broken[1]}; load a checkpoint before the next step")
        if optimizer is None or not math.isfinite(norm):
            written = self._take_back() if early else []
            if written:
                self.broken = (NonFiniteGradientError, (
                    f"step {self.host.step}: the gradient is not finite (norm {norm}); the early updates write in "
                    f"place and had updated layers {sorted(written)}, so the state is that of a step part-applied"))
                raise NonFiniteGradientError(f"{self.broken[1]}; load a checkpoint before the next step")
            return RankStep(loss_value, norm, 0.0, optimizer is not None, **timing)
        clip = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm + 1e-6))
        if early:
            self.early.commit()
        self._start_update(optimizer, clip, host_started=early)
        return RankStep(loss_value, norm, clip, False, **timing)

    def _next_round(self) -> int:
        self.host.step += 1
        self.routes.rounds += 1
        return self.host.step

    def _start_early(self, opt: AdamW) -> None:
        """This step's round of host updates, each starting once its layer's gradient has landed."""
        update = self._host_update(opt, self._next_round(), 1.0)
        self.routes.early = self.early.start(lambda layer_id, current, threads: update(layer_id, threads, current))

    def _stream_gradients(self, opt: AdamW) -> list[int]:
        """This step's streamed gradients: each staged piece updates its layer in place as it lands
        (bias correction of the step about to be taken), unless it is not finite (`finite`: the device's
        word for the whole layer; None: checked here); returns the list that collects the layers of
        non-finite pieces (none applied after the first)."""
        step, host, segments = self.host.step + 1, self.host, self._decay_segments(opt)
        nonfinite: list[int] = []

        def apply(layer_id: int, staged: torch.Tensor, lo: int, hi: int, finite: bool | None) -> None:
            if nonfinite or not (all_finite(staged) if finite is None else finite):
                nonfinite.append(layer_id)
                return
            layer = host.layers[layer_id]
            grad = host.numpy(staged)
            for start, end, decay in segments[layer_id]:
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    here = layer.at(a, b)
                    cpu_adamw.adamw_step(
                        host.numpy(layer.master[here]), grad[a - lo : b - lo], host.numpy(layer.exp_avg[here]),
                        host.numpy(layer.exp_avg_sq[here]),
                        None if layer.delivery is None else host.numpy(layer.delivery[here]),
                        lr=opt.lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                        weight_decay=opt.weight_decay if decay else 0.0, step=step, grad_scale=1.0,
                        num_threads=self.updates.num_threads)

        self.routes.apply_gradient = apply
        return nonfinite

    def _take_back(self) -> list[int]:
        """Undo this step's early round, if it started (the state is as before the step); in place, stop
        it and return the layers it had written (they keep the update, and the step its count)."""
        if self.early.round is None:
            return []
        updated = self.early.take_back()
        written = updated if self.early.in_place else []
        if not written:
            self.host.step -= 1
            self.routes.rounds -= 1
        return written

    def _host_update(self, opt: AdamW, step: int, clip: float):
        """`update(layer_id, num_threads, current=None)`: AdamW on this rank's chunks of a layer, in
        place, or from `current` = (master, exp_avg, exp_avg_sq, spare) into the spare."""
        rounds, host, routes = self.routes.rounds, self.host, self.routes
        segments = self._decay_segments(opt)

        def update(layer_id: int, num_threads: int | None, current=None) -> None:
            layer = host.layers[layer_id]
            master, exp_avg, exp_avg_sq, spare = current or (layer.master, layer.exp_avg, layer.exp_avg_sq, None)
            arrays = [host.numpy(t) if t is not None else None
                      for t in (master, layer.grad, exp_avg, exp_avg_sq, layer.delivery)]
            spare = None if spare is None else [host.numpy(t) for t in spare]
            for lo, hi in routes.owned(layer_id):
                for start, end, decay in segments[layer_id]:
                    a, b = max(lo, start), min(hi, end)
                    if a >= b:
                        continue
                    here = layer.at(a, b)  # where [a, b) sits in this host's arrays
                    p, g, m, v, out = (x[here] if x is not None else None for x in arrays)
                    cpu_adamw.adamw_step(
                        p, g, m, v, out, lr=opt.lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                        weight_decay=opt.weight_decay if decay else 0.0, step=step, grad_scale=clip,
                        num_threads=num_threads, to=None if spare is None else tuple(x[here] for x in spare))
            if self.flags is not None:
                self.flags.mark_updated(self.rank, layer_id, rounds)

        return update

    def _start_update(self, opt: AdamW, clip: float, host_started: bool = False) -> None:
        """AdamW on this rank's chunks of every layer, in update order, on the update thread (unless
        the host layers' round already started early), and on the device for the device state."""
        step = self.host.step if host_started else self._next_round()
        segments = self._decay_segments(opt)  # cached per decay setting
        if self.device_state is not None:
            streams = self.executor.streams
            for stream in ("compute", "d2h"):  # every gradient of the step is there
                streams.wait("update", streams.record(stream))
            with streams.on("update"):
                for layer_id in sorted(self.device_state.layers):  # the order the next forward needs them
                    self.device_state.update(layer_id, segments[layer_id], opt, step=step, clip=clip)
                    self.device_state.ready[layer_id] = streams.record("update")
        if self.streamed is not None:  # the host gradient is whole (routes.finish waited for it)
            for layer_id in self.streamed.order:  # this rank's chunks (every chunk with one rank)
                self.streamed.update(layer_id, segments[layer_id], opt, step=step, clip=clip,
                                     ranges=self.routes.owned(layer_id))
        if not host_started:
            update = self._host_update(opt, step, clip)
            self.updates.start(lambda layer_id, threads: update(layer_id, threads))
        self.executor.resident_stale.update(self.executor.resident_ids)

    def _decay_segments(self, opt: AdamW) -> list[list[tuple[int, int, bool]]]:
        key = bool(opt.no_decay_groups)
        if key not in self._segments:
            self._segments[key] = [decay_segments(layer, opt) for layer in self.graph.layers]
        return self._segments[key]

    @property
    def last_duration_s(self) -> float:
        """Wall time of this rank's last finished round of updates."""
        return self.updates.last_duration_s

    def flush(self) -> None:
        """Wait for the pending updates: this rank's, and every other rank's."""
        self.updates.flush()
        for layer_id in range(len(self.graph.layers)):
            self.routes.wait_updated(layer_id)

    def sync_host(self) -> None:
        """Flush, then bring the host state up to date: the state kept on the device copied down
        (by each host's first rank: every rank holds the same); with several hosts, once every
        host's updates are done (each host holds only its share: `gather_layer` reads the rest)."""
        self.flush()
        if self.device_state is not None and (self.leader or self.device_state.sharded):
            self.device_state.store_to_host()  # sharded: each rank its own chunks
            if self.device_state.sharded and self.comm is not None and self.comm.hosts == 1:
                self.comm.barrier()  # every rank's chunks are there before any reads them
        if self.comm is not None and self.comm.hosts > 1:
            self.comm.barrier()

    def gather_layer(self, layer_id: int, name: str = "master") -> torch.Tensor:
        """A new CPU tensor of the whole layer's host array `name` ("master", "exp_avg", ...) on
        every rank, after `sync_host`: with several hosts a collective of every rank, each run of
        chunks broadcast from the first rank of the host that holds it (one layer in memory)."""
        arrays = self.host.layers[layer_id]
        src = getattr(arrays, name)
        if arrays.whole:
            return src.clone()
        out = torch.empty(arrays.layout.numel, dtype=src.dtype)
        G = self.comm.local_world_size
        runs: list[list[int]] = []  # [lo, hi, holding host] of consecutive chunks held by one host
        for (lo, hi), owner in zip(self.routes.chunks[layer_id], self.routes.owners[layer_id]):
            if runs and runs[-1][2] == owner // G and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, owner // G])
        for lo, hi, h in runs:
            if h == self.comm.host_index:
                out[lo:hi] = src[arrays.at(lo, hi)]
            self.comm.broadcast_all_(out[lo:hi], h * G)
        return out

    def reload(self, step: int) -> None:
        """The host state was rewritten (a checkpoint): reload the resident weights and the state
        kept on the device, take its step."""
        self.flush()
        self.broken = None
        self.host.step = step
        self.executor.resident_stale.update(self.executor.resident_ids)
        if self.device_state is not None:
            self.device_state.load_from_host()

    def close(self) -> None:
        try:
            self.updates.flush()
            if self.streamed is not None:  # its copies write the host state, which closes after this
                self.streamed.close()
            # the model's parameters (host views); sharded: each rank its own chunks
            if self.device_state is not None and (self.leader or self.device_state.sharded):
                self.device_state.store_to_host()
        finally:
            self.updates.close()
            self.routes.close()
            self.executor.close()
            if self.comm is not None:
                self.comm.close()


def build_rank(*, model, graph: LayerGraph, plan, program, host: HostState, device: torch.device,
               compute_dtype: torch.dtype, loss_chunk_tokens: int | None, update_order: list[int], rank: int = 0,
               world_size: int = 1, comm=None, flags=None, compile_blocks: bool = False,
               device_state: DeviceState | None = None) -> Rank:
    """A rank on `device`: its executor (streams, buffers, routes) and its step. The same for the
    engine's own process, a worker process and a torchrun process. `device_state`: the state kept on
    the device, when the caller made it (lean layers, loaded there); else made here from the host's."""
    allocator.configure(device, plan.budget_bytes)
    executor = StreamedExecutor(
        model, graph, host, program, device=device, compute_dtype=compute_dtype, loss_chunk_tokens=loss_chunk_tokens,
        compile_blocks=compile_blocks,
        routes_for=lambda streams: Routes(plan=plan, host=host, streams=streams, rank=rank, world_size=world_size,
                                          comm=comm, flags=flags))
    if device_state is None and plan.device_state:
        owned = ({i: executor.routes.owned(i) for i in plan.device_state}
                 if plan.device_state_sharded and world_size > 1 else None)  # sharded: this rank's chunks
        device_state = DeviceState(host, plan.device_state, device=device, owned=owned)
    streamed = None
    if plan.streamed_updates:
        # Several ranks: each marks a streamed layer updated once its own chunks are back on the host (the
        # round cannot move on before: the next step's loads wait for every rank's mark).
        mark = None if flags is None else (
            lambda layer_id: flags.mark_updated(rank, layer_id, executor.routes.rounds))
        streamed = StreamedUpdates(host, plan.streamed_updates, streams=executor.streams, device=device, on_done=mark)

    def rebind(layer_ids: list[int]) -> None:
        """Early updates swapped these layers' masters: fp32 parameters view the current one."""
        for layer_id in layer_ids:
            arrays = host.layers[layer_id]
            for name, view in arrays.param_views(arrays.master).items():
                param = model.get_parameter(name)
                if param.dtype == view.dtype:
                    param.data = view

    local = comm.local_world_size if comm is not None else world_size  # the ranks sharing this host's cores
    return Rank(executor=executor, host=host, graph=graph, update_order=update_order, rank=rank, comm=comm,
                flags=flags, num_threads=update_threads(device, local), device_state=device_state,
                early_order=plan.early_order, on_swap=rebind, streamed=streamed, early_in_place=plan.early_in_place)


def update_threads(device: torch.device, world_size: int) -> int | None:
    """CPU threads of one rank's optimizer: the cores shared by the ranks, less one per GPU (its
    work is issued by a thread of its own); None (all) for a single CPU rank."""
    cores = os.cpu_count() or 2
    if device.type == "cuda":
        return max(1, (cores - world_size) // world_size)
    return None if world_size == 1 else max(1, cores // world_size)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite, in one pass that writes nothing: the least and greatest
    element (NaN propagates to both; an infinity is one of them). `torch.isfinite(t).all()` writes a
    boolean tensor the size of `t` first, 35-60x as long on a host tensor of 100M elements, 10-15x the
    AdamW update of the same elements (benchmarks/LOG.md)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def decay_segments(layer, optimizer: AdamW) -> list[tuple[int, int, bool]]:
    """Runs of consecutive parameters sharing a weight-decay setting: (start, end, decay)."""
    segments: list[tuple[int, int, bool]] = []
    start = 0
    for p in layer.params:
        decay = not (optimizer.no_decay_groups and p.no_decay)
        end = start + p.numel
        if segments and segments[-1][2] == decay and segments[-1][1] == start:
            segments[-1] = (segments[-1][0], end, decay)
        else:
            segments.append((start, end, decay))
        start = end
    return segments
