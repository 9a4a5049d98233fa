"""world_size > 1 on CPU processes (gloo): every route combination against single-process
torch.optim.AdamW on the same global batches, and what happens when a rank fails."""

import copy
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import slidedp
from slidedp import WorkerError
from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.scheduler.search import baselines
from slidedp.scheduler.solve import fixed_plan
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, reference_loss
from tests.models import VOCAB, PlainBlock, PlainLM, make_model

ROUTES = [("replicated", "cpu"), ("replicated", "gpu"), ("sharded", "cpu"), ("sharded", "gpu")]


def routed_plan(model, world_size, route, *, micro_batches=1, activation="recompute", per_group=None, hosts=1,
                vocab_streamed=(), vocab_chunk_numel=None):
    """A plan with the given routes (h100-sxm figures allow every route; predictions are unused);
    `vocab_streamed`: "prologue" / "epilogue", whose vocabulary table streams by row chunks."""
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)

    def decide(costs, budget):
        d = baselines.uniform(costs, window=2, activation=activation, chunk_multiple=2, route=route)
        for layer_id, (delivery, reduction) in (per_group or {}).items():
            d = d.replace_layers([layer_id], delivery=delivery, reduction=reduction)
        return d

    return fixed_plan(graph, decide, method="test", budget_bytes=1 << 30, hardware=PRESETS["h100-sxm"],
                      world_size=world_size, precision="fp32", micro_batches=micro_batches, hosts=hosts,
                      link_bytes_per_s=50e9 if hosts > 1 else 0.0,
                      vocab_streamed={graph.prologue.id if n == "prologue" else graph.epilogue.id for n in vocab_streamed},
                      vocab_chunk_numel=vocab_chunk_numel)


def compile_ranks(model, world_size, plan, micro_batches=1):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           world_size=world_size, micro_batches=micro_batches, plan=plan,
                           optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP)


def train_against_reference(engine, ref, *, world_size, steps=5, accumulation=2, seed=1):
    """`steps` steps on global batches of world_size x BATCH x accumulation rows, with unequal valid
    tokens per rank; asserts losses and norms and, at the end, every parameter against torch.optim.AdamW."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(seed)
    rows = world_size * BATCH * accumulation
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
        labels = ids.clone()
        labels[torch.rand(rows, SEQ, generator=gen) < 0.25] = -100
        labels[: rows // world_size, SEQ // 2 :] = -100  # rank 0 has far fewer valid tokens
        loss = engine.step(ids, labels)
        ref_loss = reference_loss(ref, ids, labels)
        opt.zero_grad()
        ref_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
        assert engine.last_step.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert engine.last_step.clip_coef < 1.0, "the test must exercise clipping"
    state = engine.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)
    return state


# three ranks: uneven shards and reductions. Replicated delivery with CPU reduction has neither, so it
# runs on two ranks by default; every other route on three (its two-rank case is the even special case, slow).
@pytest.mark.parametrize("world_size, route", [
    pytest.param(w, r, id=f"{w}-{'-'.join(r)}",
                 marks=[] if (w == 2) == (r == ("replicated", "cpu")) else [pytest.mark.slow])
    for w in (2, 3) for r in ROUTES])
def test_routes_match_torch_adamw(world_size, route):
    """Tied weights, clipping, two passes of gradient accumulation, two chunks per rank and layer."""
    model = make_model("llama", tied=True)
    ref = copy.deepcopy(model).eval()
    with compile_ranks(model, world_size, routed_plan(model, world_size, route)) as engine:
        state = train_against_reference(engine, ref, world_size=world_size)
        assert len(state) > len(dict(ref.named_parameters()))  # both tied names


def test_mixed_routes_shared_pass_and_kept_activations():
    """Each layer group on its own route, two micro-batches per pass, activations kept."""
    model = make_model("qwen3", tied=False)
    ref = copy.deepcopy(model).eval()
    last = len(model.model.layers) + 1
    plan = routed_plan(model, 2, ("sharded", "cpu"), micro_batches=2, activation="keep",
                       per_group={0: ("replicated", "gpu"), last: ("sharded", "gpu")})
    assert {(d.delivery, d.reduction) for d in plan.decisions} == {("replicated", "gpu"), ("sharded", "cpu"),
                                                                   ("sharded", "gpu")}
    with compile_ranks(model, 2, plan, micro_batches=2) as engine:
        train_against_reference(engine, ref, world_size=2, steps=4)
        assert engine.evaluate(torch.randint(0, VOCAB, (3, SEQ))) > 0  # rows padded to the ranks


class RaisingBlock(PlainBlock):
    """Raises in rank 1's process (a stand-in for any error a rank can meet)."""

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("injected failure")
        return super().forward(x)


def _shm_entries():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _assert_all_gone(engine, shm_before):
    procs = engine.runner.procs
    engine.close()
    assert not any(p.is_alive() for p in procs)
    assert _shm_entries() <= shm_before
    assert not os.path.exists(engine.runner._tmp)


def test_a_rank_that_raises_stops_every_process():
    model = PlainLM()
    model.trunk[1] = RaisingBlock(32)
    shm_before = _shm_entries()
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=2)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="rank 1 failed.*injected failure") as info:
        engine.step(torch.randint(0, VOCAB, (2 * BATCH, SEQ)))
    assert info.value.rank == 1
    assert time.perf_counter() - t0 < 60
    _assert_all_gone(engine, shm_before)


def test_a_killed_rank_stops_every_process(tmp_path):
    model = make_model("llama")
    shm_before = _shm_entries()
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=2)
    batch = torch.randint(0, VOCAB, (2 * BATCH, SEQ))
    engine.step(batch)
    os.kill(engine.runner.procs[1].pid, signal.SIGKILL)
    engine.runner.procs[1].join(30)  # gone before the next step: sending it the step fails
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="rank 1 failed: its process exited"):
        engine.step(batch)
    assert time.perf_counter() - t0 < 60
    with pytest.raises(RuntimeError, match="not saved: rank 1 failed"):  # no checkpoint of what is left
        engine.save_checkpoint(tmp_path / "after-failure")
    assert not (tmp_path / "after-failure").exists()
    _assert_all_gone(engine, shm_before)


LOCKING_RUN = """
import torch, slidedp
from tests.multirank.locking_model import LockingLM
with slidedp.compile(LockingLM(), "1GiB", batch_size=2, seq_len=8, device="cpu", precision="fp32",
                     world_size=2) as engine:
    engine.step(torch.randint(0, 96, (4, 8)))
"""


def test_ranks_that_made_a_lock_leave_no_semaphore_behind(tmp_path):
    """A rank's process ends without waiting on its threads, yet unlinks what multiprocessing made in it:
    the resource tracker finds no leaked semaphore when the program exits."""
    env = dict(os.environ, LOCKS_DIR=str(tmp_path), PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[2]))
    run = subprocess.run([sys.executable, "-c", LOCKING_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert len(os.listdir(tmp_path)) == 2  # each rank made its lock
    assert "leaked semaphore" not in run.stderr, run.stderr


def device_state_plan(model, world_size, *, prologue, sharded=None, blocks=2):
    from slidedp.scheduler.decisions import SolverOptions
    from slidedp.scheduler.solve import solve_plan

    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)
    return solve_plan(graph, budget_bytes=1 << 30, hardware=PRESETS["h100-sxm"], world_size=world_size,
                      precision="fp32", options=SolverOptions(device_state_blocks=blocks, device_state_prologue=prologue,
                                                              device_state_sharded=sharded))


# three ranks, the prologue sharded: test_sharded_device_state_keeps_a_third_per_rank... trains it by default
@pytest.mark.parametrize("world_size, prologue, sharded", [(2, False, False), (3, True, False), (2, False, True),
                                                           pytest.param(3, True, True, marks=pytest.mark.slow)],
                         ids=["2-replicated", "3-prologue-replicated", "2-sharded", "3-prologue-sharded"])
def test_optimizer_state_on_the_devices_matches_torch_adamw(world_size, prologue, sharded, tmp_path):
    """The first two blocks (and the prologue, with the tied head's weight) keep their optimizer
    state on the devices: every rank the same copy (gradient all-reduced, the same update
    everywhere, rank 0 writes it back), or sharded by chunk owner (gradient reduce-scattered, each
    rank updates and writes back its chunks, weights all-gathered at each load). Exact against
    torch.optim.AdamW (clipping, two passes), and a checkpoint of it restores the same weights."""
    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).eval()
    plan = device_state_plan(model, world_size, prologue=prologue, sharded=None if sharded else False)
    assert plan.device_state == ((0,) if prologue else ()) + (1, 2)
    assert plan.device_state_sharded == sharded
    with compile_ranks(model, world_size, plan) as engine:
        state = train_against_reference(engine, ref, world_size=world_size, steps=4)
        engine.save_checkpoint(tmp_path / "ckpt")
        engine.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, state[k]) for k, v in engine.state_dict().items())


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_set_of_layers_that_is_no_prefix_keeps_its_state_on_the_devices(sharded):
    """Blocks 1 and 3 on the devices, block 2 between them on the host (the planner places the
    state per layer): exact against torch.optim.AdamW on 2 ranks, full copies or sharded."""
    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).eval()
    plan = device_state_plan(model, 2, prologue=False, sharded=None if sharded else False)
    plan = plan.replace(device_state=(1, 3))
    assert plan.device_state_sharded == sharded and not plan.problems()
    with compile_ranks(model, 2, plan) as engine:
        train_against_reference(engine, ref, world_size=2, steps=3)


def test_sharded_device_state_keeps_a_third_per_rank_and_round_trips_checkpoints(tmp_path):
    """Three ranks: each keeps the device state of its own chunks (about 1/3 of the full copy each,
    every chunk on exactly one rank); a checkpoint written from the shards (the same on-disk format)
    loads bitwise into an engine keeping full copies and into a fresh sharded one, which then steps
    exactly like the engine that wrote it."""
    world_size = 3
    model = make_model("qwen3", tied=True)
    ref = copy.deepcopy(model).eval()
    sharded = device_state_plan(model, world_size, prologue=True)
    full = device_state_plan(model, world_size, prologue=True, sharded=False)
    assert sharded.device_state_sharded and not full.device_state_sharded
    assert "sharded by chunk owner over 3 ranks" in sharded.summary()
    assert sharded.memory["device_state_bytes"] < full.memory["device_state_bytes"] / 2
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (world_size * BATCH * 2, SEQ), generator=gen) for _ in range(2)]
    with compile_ranks(model, world_size, sharded) as engine:
        shard_bytes = engine.runner.device_state_bytes()
        train_against_reference(engine, ref, world_size=world_size, steps=3)
        engine.save_checkpoint(tmp_path / "ckpt")
        written = engine.state_dict()
        losses = [engine.step(b) for b in batches]
        final = engine.state_dict()
    with compile_ranks(make_model("qwen3", tied=True, seed=1), world_size, full) as engine:
        full_bytes = engine.runner.device_state_bytes()
        engine.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, written[k]) for k, v in engine.state_dict().items())
    assert len(set(full_bytes)) == 1 and sum(shard_bytes) == full_bytes[0]  # each chunk kept once
    assert max(shard_bytes) <= full_bytes[0] / world_size * 1.1, (shard_bytes, full_bytes)
    assert max(shard_bytes) <= sharded.memory["device_state_bytes"]  # as planned
    with compile_ranks(make_model("qwen3", tied=True, seed=1), world_size, sharded) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, written[k]) for k, v in engine.state_dict().items())
        assert [engine.step(b) for b in batches] == losses
        assert all(torch.equal(v, final[k]) for k, v in engine.state_dict().items())


def test_a_sharded_device_state_is_refused_on_one_rank():
    model = make_model("qwen3", tied=True)
    plan = device_state_plan(model, 2, prologue=False)
    assert plan.device_state_sharded and plan.problems(2) == []
    assert plan.problems(1)  # its owners name rank 1
    one_owner = plan.replace(decisions=tuple(dataclasses.replace(d, owners=(0,) * d.chunks, delivery="replicated",
                                                                 reduction="cpu") for d in plan.decisions))
    assert any("device_state_sharded" in p and "runs on 1" in p for p in one_owner.problems(1))
    assert any("device_state_sharded" in p for p in plan.replace(device_state=()).problems(2))
    assert slidedp.Plan.from_dict(plan.to_dict()).device_state_sharded


def test_one_rank_in_a_worker_process(monkeypatch):
    """SLIDEDP_WORKER_PROCESSES=1 runs even one rank through the worker path (CPU reduction in turn)."""
    monkeypatch.setenv("SLIDEDP_WORKER_PROCESSES", "1")
    model = make_model("llama", tied=True)
    ref = copy.deepcopy(model).eval()
    with compile_ranks(model, 1, routed_plan(model, 1, ("replicated", "cpu"))) as engine:
        assert len(engine.runner.procs) == 1
        train_against_reference(engine, ref, world_size=1)


@pytest.mark.parametrize("route", [("replicated", "cpu"), ("sharded", "gpu")], ids=["replicated-cpu", "sharded-gpu"])
def test_streamed_updates_on_every_rank_match_torch_adamw(route):
    """The prologue and two blocks updated at the step boundary by each rank on its own device (its
    chunks), the others waiting for every rank's mark; tied weights, clipping, two passes."""
    model = make_model("llama", tied=True)
    ref = copy.deepcopy(model).eval()
    plan = routed_plan(model, 2, route)
    plan = plan.replace(streamed_updates=plan.update_order[:3])
    with compile_ranks(model, 2, plan) as engine:
        train_against_reference(engine, ref, world_size=2, steps=3)


def test_a_grouped_plan_on_two_ranks_matches_torch_adamw():
    """A plan of BATCH-row micro-batches given to a two-rank compile asked for one-row ones with group_rows
    (as many rows a rank per step): every rank takes the plan's grouping, and the steps match AdamW."""
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    plan = routed_plan(model, 2, ("sharded", "gpu"), micro_batches=2)
    with slidedp.compile(model, "1GiB", batch_size=1, seq_len=SEQ, device="cpu", precision="fp32", world_size=2,
                         micro_batches=2 * BATCH, plan=plan, group_rows=True,
                         optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP) as engine:
        assert (engine.plan.workload.batch_size, engine.graph.batch_size) == (BATCH, BATCH)
        train_against_reference(engine, ref, world_size=2, steps=3)
