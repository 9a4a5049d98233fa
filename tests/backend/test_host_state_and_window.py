"""Host state layout and sharing; the weight-window schedule against a brute-force replay."""

import os
import subprocess
import sys

import pytest
import torch

from slidedp.backend.state.host_state import PAGE_BYTES, HostState
from slidedp.backend.lowering.weight_window import schedule_window
from slidedp.scheduler.problem.lanes import window_loads
from slidedp.ir.build import build_layer_graph
from tests.models import make_model


def test_layout_is_page_aligned_and_tied_weights_are_stored_once():
    model = make_model("llama", tied=True)
    graph = build_layer_graph(model, batch_size=1, seq_len=8, compute_dtype=torch.float32)
    host = HostState(graph, delivery_bf16=True, grad_dtype="bfloat16")
    try:
        specs = [s for lay in host.layouts for s in (lay.master, lay.exp_avg, lay.exp_avg_sq, lay.delivery, lay.grad)]
        assert all(s.offset_bytes % PAGE_BYTES == 0 for s in specs)
        ends = sorted((s.offset_bytes, s.offset_bytes + s.nbytes) for s in specs)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # no overlap
        unique = {id(p): p.numel() for p in model.parameters()}
        assert sum(lay.numel for lay in host.layouts) == sum(unique.values())
        assert host.layers[1].delivery.dtype == torch.bfloat16 and host.layers[1].grad.dtype == torch.bfloat16
    finally:
        host.close()
        host.close()


def test_another_process_sees_the_same_memory():
    graph = build_layer_graph(make_model("gpt2"), batch_size=1, seq_len=8, compute_dtype=torch.float32)
    host = HostState(graph, delivery_bf16=False, grad_dtype="float32")
    try:
        host.layers[1].master[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        offset = host.layouts[1].master.offset_bytes
        code = (
            "import mmap, os, sys, numpy as np\n"
            f"fd = os.open('/proc/{os.getpid()}/fd/{host.fd}', os.O_RDWR)\n"
            f"m = mmap.mmap(fd, {host.nbytes})\n"
            f"a = np.frombuffer(m, dtype=np.float32, count=4, offset={offset})\n"
            "print(a.tolist()); a[0] = 42.0\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, pass_fds=(host.fd,),
                             check=True)
        assert out.stdout.strip() == "[1.0, 2.0, 3.0, 4.0]"
        assert host.layers[1].master[0].item() == 42.0  # written by the other process, no copy
    finally:
        host.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_populate_faults_in_every_page_and_keeps_what_was_written(threads):
    """What `pin` does before registering the file: every page present, nothing written changed."""
    graph = build_layer_graph(make_model("llama"), batch_size=1, seq_len=8, compute_dtype=torch.float32)
    host = HostState(graph, delivery_bf16=True, grad_dtype="bfloat16")
    try:
        values = torch.arange(5, dtype=torch.float32) + 0.5
        host.layers[1].master[:5] = values
        before = host.allocated_bytes()
        assert before < host.nbytes  # the file is sparse: only the pages written so far
        if not host.populate(threads):
            pytest.skip("this kernel cannot populate a mapping (MADV_POPULATE_WRITE: Linux 5.14+)")
        assert host.allocated_bytes() >= host.nbytes > before
        assert torch.equal(host.layers[1].master[:5], values)
        assert not host.layers[1].exp_avg.any() and not host.layers[2].grad.any()
    finally:
        host.close()


def _replay(sequence, window, sched):
    """Brute force: replay slots; every visit finds its block; loads never clobber a needed block."""
    content = [None] * window
    loads = {load.position: load for load in sched.loads}
    for p, block in enumerate(sequence):
        if p in loads:
            load = loads[p]
            assert load.issue_after < p
            # the evicted content is not used between issue time and this position
            for q in range(load.issue_after + 1, p):
                assert sched.slot_of[q] != load.slot
            content[load.slot] = block
        assert content[sched.slot_of[p]] == block
    return len(sched.loads)


@pytest.mark.parametrize("n_blocks", [1, 2, 5])
@pytest.mark.parametrize("window", [1, 2, 3, 6])
def test_window_schedule_is_valid_and_reuses_resident_blocks(n_blocks, window):
    sequence = list(range(n_blocks)) + list(range(n_blocks - 1, -1, -1))
    sched = schedule_window(n_blocks, window, window_loads(n_blocks, window))
    n_loads = _replay(sequence, window, sched)
    # Belady on forward-then-backward: the last min(window, n) blocks are not loaded again.
    assert n_loads == 2 * n_blocks - min(window, n_blocks)


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window"):
        schedule_window(2, 0, ())
    with pytest.raises(ValueError, match="no window load"):
        schedule_window(2, 1, window_loads(2, 1)[:-1])  # a plan whose loads miss a block's reload
