"""The same ranks launched by torchrun (one process per rank, no controller) on CPU."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, reference_loss
from tests.models import VOCAB, make_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun")
def test_torchrun_ranks_match_torch_adamw(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(ROOT / "tests/multirank/torchrun_job.py"),
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    state = load_file(tmp_path / "state.safetensors")
    losses = load_file(tmp_path / "losses.safetensors")["losses"].tolist()
    assert (tmp_path / "checkpoint" / "engine.json").exists()

    ref = make_model("llama", tied=True).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2 * BATCH * 2, SEQ), generator=gen)
        loss = reference_loss(ref, ids, ids)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5, msg=name)
