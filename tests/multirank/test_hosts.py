"""Several hosts under torchrun, simulated on one machine: two launches of `torchrun --nnodes 2`
(rendezvous on 127.0.0.1), each "host" holding only the chunks its ranks own, its ranks updating them.
Exact against torch.optim.AdamW on the global batch (clipping, gradient accumulation, a skipped
step); a host's state about half the whole, as the plan counts it; a checkpoint written by both hosts
and read back bitwise; resharding 2 -> 1 and 1 -> 2 hosts; a killed host stops the other, named."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slidedp
from slidedp.costmodel import memory as mem
from slidedp.run.checkpoint import read_engine_meta, read_layer_arrays, verify_checkpoint
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, reference_loss
from tests.models import make_model
from tests.multirank.hosts_job import POISONED, batches

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                                reason="no torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hosts(out: Path, hosts: int, per_host: int, *extra: str) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    return [subprocess.Popen([TORCHRUN, f"--nnodes={hosts}", f"--node-rank={k}", f"--nproc-per-node={per_host}",
                              "--master-addr=127.0.0.1", f"--master-port={port}",
                              str(ROOT / "tests/multirank/hosts_job.py"), str(out), *extra],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for k in range(hosts)]


def one_host_engine():
    return slidedp.compile(make_model("llama", tied=True), "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu",
                           precision="fp32", optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP)


def assert_same_arrays(a: Path, b: Path) -> None:
    x, y = read_layer_arrays(a), read_layer_arrays(b)
    assert x.keys() == y.keys()
    for key in x:
        assert torch.equal(x[key], y[key]), key
    assert read_engine_meta(a)["step"] == read_engine_meta(b)["step"]


@pytest.mark.parametrize("hosts, per_host", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_hosts_shard_the_state_match_torch_adamw_and_reshard_checkpoints(tmp_path, hosts, per_host):
    world_size = hosts * per_host
    data = batches(world_size)
    # one host first: a checkpoint after one step, and the step after it
    with one_host_engine() as engine:
        engine.step(data[0])
        engine.save_checkpoint(tmp_path / "one")
        one_next = engine.step(data[4])
        one_state = engine.state_dict()

    procs = start_hosts(tmp_path, hosts, per_host, str(tmp_path / "one"))
    for p in procs:
        _, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    losses, skipped = result["losses"], result["skipped"]
    state = load_file(tmp_path / "state.safetensors")

    # exact against torch AdamW; the poisoned step skipped on every host
    ref = make_model("llama", tied=True).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    assert skipped == [s == POISONED for s in range(4)]
    for step in range(4):
        if step == POISONED:
            assert losses[step] != losses[step]  # nan
            continue
        loss = reference_loss(ref, data[step], data[step])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)

    # each host holds its share: every element once over the hosts, about 1/hosts of the bytes each,
    # and what the plan charges a host
    memory = result["memory"][::per_host]
    graph_numels = [sum(m["held_numels"][i] for m in memory) for i in range(len(memory[0]["held_numels"]))]
    whole = mem.host_state_bytes(graph_numels, 4, control_ints=mem.step_flag_ints(per_host, len(graph_numels)))
    for m in memory:
        assert m["allocated_bytes"] <= m["state_bytes"] <= whole / hosts + 5 * mem.HOST_PAGE_BYTES * len(graph_numels)
    assert result["plan_host_memory"]["state"] == max(m["state_bytes"] for m in memory)
    assert sum(graph_numels) == sum(p.numel() for p in make_model("llama", tied=True).parameters())

    # the checkpoint of both hosts: one file per layer and host, all in the manifest; bitwise round trip
    two = tmp_path / "two-hosts"
    manifest = verify_checkpoint(two)
    assert sum(".host-" in rel for rel in manifest["files"]) == hosts * len(graph_numels)
    assert result["again"] == losses[3]
    again = load_file(tmp_path / "state_again.safetensors")
    for name in state:
        assert torch.equal(state[name], again[name]), name

    # 1 -> 2 hosts: the one-host checkpoint, read by both hosts and written again, bitwise the same;
    # the step after it as on one host
    assert_same_arrays(tmp_path / "one", tmp_path / "one-resaved")
    assert losses[4] == pytest.approx(one_next, rel=1e-5)
    from_one = load_file(tmp_path / "from_one.safetensors")
    for name in one_state:
        torch.testing.assert_close(from_one[name], one_state[name], rtol=1e-5, atol=1e-6, msg=name)

    # 2 -> 1 host: the hosts' checkpoint on one host, written again bitwise the same; step 3 as on two
    with one_host_engine() as engine:
        engine.load_checkpoint(two)
        engine.save_checkpoint(tmp_path / "two-resaved")
        assert engine.step(data[3]) == pytest.approx(losses[3], rel=1e-5)
        for name, value in engine.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)
    assert_same_arrays(two, tmp_path / "two-resaved")


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hosts_stream_the_vocabulary_and_match_torch_adamw(tmp_path, tied):
    """The embedding and head (or one tied table) streamed by row chunks over 2 hosts (docs/design.md
    §4.14): each host holds its ranks' parts of the tables, row chunks cross its chunks' boundaries; two
    micro-batches a pass, two passes a step, clipping; exact against torch.optim.AdamW on the global batch."""
    procs = start_hosts(tmp_path, 2, 1, "--vocab-tied" if tied else "--vocab")
    for p in procs:
        _, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-4000:]
    result = json.loads((tmp_path / "vocab_result.json").read_text())
    assert [e[:3] for e in result["edges"]] == [["streamed", "sharded", "gpu"]] * 2
    assert result["vocab_chunk_rows"] == 7
    edge_numels = [e[3] for e in result["edges"]]
    assert result["held_numels"][0] < edge_numels[0]  # in part
    assert tied or result["held_numels"][-1] < edge_numels[1]  # a tied table is the prologue's
    assert result["clip_coef"] < 1.0, "the test must exercise clipping"
    state = load_file(tmp_path / "vocab_state.safetensors")
    ref = make_model("llama", tied=tied).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step, ids in enumerate(batches(2, 3, passes=2)):
        loss = reference_loss(ref, ids, ids)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert result["losses"][step] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)


def test_hosts_stream_their_gradients_into_the_update_and_match_torch_adamw(tmp_path):
    """Every gradient streamed into its update over 2 hosts (docs/design.md §4.15): each owner applies
    the chunks it owns on its own host as they land, no host keeps a gradient; exact against
    torch.optim.AdamW on the global batch (no clipping)."""
    procs = start_hosts(tmp_path, 2, 1, "--streamed-gradients")
    for p in procs:
        _, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-4000:]
    result = json.loads((tmp_path / "grads_result.json").read_text())
    assert result["no_host_gradient"]
    state = load_file(tmp_path / "grads_state.safetensors")
    ref = make_model("llama").eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step, ids in enumerate(batches(2, 3)):
        loss = reference_loss(ref, ids, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert result["losses"][step] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    out += [child, *_descendants(child)]
    except FileNotFoundError:
        pass
    return out


def _processes_naming(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_killed_host_stops_the_other_naming_it(tmp_path):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    first, second = start_hosts(tmp_path, 2, 1, "--until-killed")
    deadline = time.monotonic() + 120
    while not (tmp_path / "training").exists():
        assert first.poll() is None and second.poll() is None and time.monotonic() < deadline, \
            (first.poll(), second.poll())
        time.sleep(0.05)
    for pid in [second.pid, *_descendants(second.pid)]:  # the whole host at once: launcher and ranks
        os.kill(pid, signal.SIGKILL)
    second.communicate(timeout=30)
    t0 = time.monotonic()
    _, stderr = first.communicate(timeout=90)
    assert first.returncode != 0
    assert time.monotonic() - t0 < 60
    assert f"host 1 (GROUP_RANK 1, hostname {socket.gethostname()}) stopped" in stderr, stderr[-3000:]
    # nothing left behind: no process of either launch, no shared memory file
    deadline = time.monotonic() + 10
    while _processes_naming(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(tmp_path)) == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in shm_after - shm_before if "slidedp" in f or "torch" in f}
