"""Several hosts under torchrun, simulated on one machine: two launches of `torchrun --nnodes 2`
(rendezvous on 127.0.0.1), each "host" with its own host state, its ranks updating the chunks they
own. Exact against torch.optim.AdamW on the global batch (clipping, gradient accumulation); a
checkpoint written from the hosts' gathered state and read back on the first host reaches the other."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, reference_loss
from tests.models import VOCAB, make_model

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hosts(out: Path, hosts: int, per_host: int) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    procs = [subprocess.Popen([TORCHRUN, f"--nnodes={hosts}", f"--node-rank={k}", f"--nproc-per-node={per_host}",
                               "--master-addr=127.0.0.1", f"--master-port={port}",
                               str(ROOT / "tests/multirank/hosts_job.py"), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(hosts)]
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
@pytest.mark.parametrize("hosts, per_host", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_hosts_match_torch_adamw_and_share_a_checkpoint(tmp_path, hosts, per_host):
    for run in run_hosts(tmp_path, hosts, per_host):
        assert run.returncode == 0, run.stderr[-4000:]
    world_size = hosts * per_host
    state = load_file(tmp_path / "state.safetensors")
    again = load_file(tmp_path / "state_again.safetensors")
    losses = load_file(tmp_path / "losses.safetensors")["losses"].tolist()
    assert (tmp_path / "checkpoint" / "engine.json").exists()

    ref = make_model("llama", tied=True).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (world_size * BATCH * 2, SEQ), generator=gen)
        loss = reference_loss(ref, ids, ids)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)
    # step 3 again from the checkpoint of step 2: the same loss and bitwise the same weights
    assert losses[3] == losses[2]
    for name in state:
        assert torch.equal(state[name], again[name]), name
