"""Preflight: compile compares what it will allocate with free host RAM, /dev/shm and device memory,
and refuses with the numbers before allocating anything."""

import pytest
import torch

import slidedp
import slidedp.run.launch
from slidedp.run import preflight
from slidedp.cli import main
from slidedp.errors import InsufficientMemoryError, SlidedpError
from tests.models import make_model
from tests.reliability.conftest import overrides

MiB = 1 << 20


def test_meminfo_and_cgroup_figures():
    text = "MemTotal:       24683584 kB\nMemFree:        21784516 kB\nMemAvailable:   24022676 kB\n"
    assert preflight.meminfo_available_bytes(text) == 24022676 * 1024
    assert preflight.meminfo_available_bytes("MemTotal: 1 kB\n") is None
    assert preflight.cgroup_available_bytes("max\n", "123\n") is None  # no limit
    assert preflight.cgroup_available_bytes("1000\n", "400\n") == 600
    assert preflight.cgroup_available_bytes("9223372036854771712\n", "1\n") is None  # v1's "no limit"
    assert preflight.cgroup_available_bytes(None, "1") is None
    assert preflight.cgroup_available_bytes("garbage", "1") is None


def test_this_machine_is_measured():
    free = preflight.available_memory("cpu")
    assert free.host_bytes > 0 and free.device_bytes is None
    assert free.shm_bytes is None or free.shm_bytes >= 0


@pytest.mark.parametrize("available, resource, numbers", [
    (preflight.Available(host_bytes=300 * MiB), "host RAM", ["300.00 MiB", "100.00 MiB"]),
    (preflight.Available(shm_bytes=10 * MiB), "/dev/shm", ["10.00 MiB", "20.00 MiB"]),
    (preflight.Available(device_bytes=5 * MiB), "device memory", ["5.00 MiB", "30.00 MiB"]),
])
def test_check_memory_refuses_with_the_numbers(available, resource, numbers):
    needs = preflight.Needs(host_state_bytes=80 * MiB, host_other_bytes=20 * MiB, shm_bytes=20 * MiB,
                            device_bytes=30 * MiB)
    with pytest.raises(InsufficientMemoryError) as info:
        preflight.check_memory(needs, available)
    err = info.value
    assert isinstance(err, SlidedpError) and isinstance(err, MemoryError) and err.resource == resource
    assert err.available_bytes < err.needed_bytes
    for n in numbers:
        assert n in str(err), str(err)
    preflight.check_memory(needs, preflight.Available())  # unknown figures are not checked
    preflight.check_memory(needs, preflight.Available(host_bytes=1 << 40, shm_bytes=1 << 40, device_bytes=1 << 40))


def test_needs_count_the_host_state_and_the_cpu_device_buffers():
    model = make_model("llama")
    numel = sum(p.numel() for p in model.parameters())
    plan = slidedp.plan(model, "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    from slidedp.ir.build import build_layer_graph

    graph = build_layer_graph(model, batch_size=2, seq_len=16, compute_dtype=torch.float32)
    cpu = preflight.compile_needs(graph, plan, "cpu", precision="fp32")
    assert 4 * 4 * numel <= cpu.host_state_bytes < 4 * 4 * numel + 64 * 4096 * len(graph.layers)  # master, 2 moments, grad
    pinned = plan.host_memory["pinned_buffers"] + plan.host_memory["offloaded_activations"]
    assert cpu.host_other_bytes == plan.peak_device_bytes + pinned and cpu.device_bytes == 0
    assert cpu.host_state_bytes + pinned == plan.peak_host_bytes  # the plan's own figure
    bf16 = preflight.compile_needs(graph, plan, "cuda", precision="bf16")
    assert bf16.host_state_bytes > 3 * 4 * numel + 2 * 2 * numel - 1  # + bf16 delivery and bf16 gradient
    assert bf16.device_bytes == plan.peak_device_bytes and bf16.host_other_bytes > 0  # pinned staging
    # a plan saved without its explanation: the same count, made from its schedule
    bare = slidedp.Plan.from_dict(plan.to_dict(explanation=False))
    again = preflight.compile_needs(graph, bare, "cpu", precision="fp32")  # (its peak_device_bytes: not known)
    assert again.host_state_bytes == cpu.host_state_bytes and again.host_other_bytes == pinned


def test_compile_checks_the_plans_host_figure(monkeypatch):
    """compile's preflight counts the plan's peak_host_bytes (host state as laid out, pinned buffers);
    compile(host_memory=) plans within it."""
    seen = []
    real = preflight.check_memory

    def spy(needs, available, **kw):
        seen.append(needs)
        return real(needs, available, **kw)

    monkeypatch.setattr(preflight, "check_memory", spy)
    engine = slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, device="cpu", precision="fp32",
                             host_memory="1GiB")
    try:
        plan = engine.plan
        assert plan.solver["host_budget_bytes"] == 1 << 30 and plan.peak_host_bytes <= 1 << 30
        assert seen[-1].host_bytes == plan.peak_host_bytes + plan.peak_device_bytes  # + the CPU's "device" buffers
        assert engine.host.nbytes == plan.host_memory["state"] + plan.host_memory["spare"]
    finally:
        engine.close()
    with pytest.raises(slidedp.InfeasibleBudgetError, match="host budget"):
        slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, device="cpu", precision="fp32",
                        host_memory=1 << 16)


def test_compile_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(preflight, "available_memory", lambda device: preflight.Available(host_bytes=64 * MiB))

    def no_allocation(*args, **kwargs):
        raise AssertionError("the host state was allocated before the preflight refused")

    monkeypatch.setattr(slidedp.run.launch, "HostState", no_allocation)
    with pytest.raises(InsufficientMemoryError, match=r"not enough host RAM: this model needs .* but only "
                                                      r"64.00 MiB \(67108864 bytes\) is available"):
        slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, device="cpu", precision="fp32")
    monkeypatch.setenv("SLIDEDP_SKIP_PREFLIGHT", "1")  # the escape hatch reaches the allocation
    with pytest.raises(AssertionError, match="allocated"):
        slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, device="cpu", precision="fp32")


def test_compile_passes_on_this_machine():
    slidedp.compile(make_model("llama"), "1GiB", batch_size=2, seq_len=16, device="cpu", precision="fp32").close()


def test_train_command_refuses_in_one_line(monkeypatch, rel_model_dir, rel_data, tmp_path, capsys):
    monkeypatch.setattr(preflight, "available_memory", lambda device: preflight.Available(host_bytes=100 * MiB))
    assert main(["train", *overrides(rel_model_dir, rel_data, tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("slidedp train: error: not enough host RAM") and "100.00 MiB" in err[-1]
    assert not any("Traceback" in line for line in err)
