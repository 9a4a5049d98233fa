"""`slidedp calibrate --link`: the link between hosts measured by an all-gather under torchrun, and
read back by `slidedp plan --link FILE`."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slidedp.cli import main
from slidedp.costmodel import ops
from slidedp.costmodel.hardware import PRESETS
from slidedp.profiler.link import link_rate_bytes_per_s, load_link, torchrun_hosts

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)


def test_the_rate_inverts_the_cost_models_collective_across_hosts():
    hw, nbytes = PRESETS["h100-sxm"], 3 * 2**30
    for hosts in (2, 3, 8):
        rate = link_rate_bytes_per_s(nbytes, 0.5, hosts)
        # with a slow link the between-hosts term sets the all-gather: the measured 0.5 s back
        assert ops.all_gather_time_s(nbytes, 4 * hosts, hw, hosts=hosts, link_bytes_per_s=rate) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="hosts >= 2"):
        link_rate_bytes_per_s(nbytes, 0.5, 1)


def test_one_host_or_no_torchrun_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nnodes"):
        torchrun_hosts()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="at least 2 hosts"):
        torchrun_hosts()


@pytest.mark.skipif(shutil.which("torchrun", path=BIN) is None, reason="no torchrun")
def test_two_launches_measure_the_link_and_plan_reads_it(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "link.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([os.path.join(BIN, "torchrun"), "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=1",
                               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "slidedp", "calibrate",
                               "--link", "--link-bytes", "8MiB", "--out", str(out)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    result = json.loads(out.read_text())
    assert result["hosts"] == 2 and result["ranks_per_host"] == 1 and result["backend"] == "gloo"
    assert result["nbytes"] == 8 * 2**20 and result["median_s"] > 0
    assert result["link_bytes_per_s"] == pytest.approx(0.5 * result["nbytes"] / result["median_s"])
    assert "GB/s per host" in outputs[0][0] and "--link " + str(out) in outputs[0][0]
    assert load_link(out) == result["link_bytes_per_s"]
    # the planner takes the file as the link
    plan_out = tmp_path / "plan.json"
    assert main(["plan", "llama-tiny", "--budget", "1GiB", "--batch-size", "1", "--seq-len", "64", "--world-size",
                 "2", "--nodes", "2", "--link", str(out), "--hardware", "h100-sxm", "--out", str(plan_out)]) == 0
    import slidedp
    assert slidedp.Plan.load(plan_out).workload.link_bytes_per_s == pytest.approx(result["link_bytes_per_s"])


def test_a_file_that_is_not_a_link_measurement_is_refused(tmp_path):
    bad = tmp_path / "hardware.json"
    bad.write_text(json.dumps({"name": "h100"}))
    with pytest.raises(ValueError, match="not a link measurement"):
        load_link(bad)
