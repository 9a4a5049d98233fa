"""Planning for several hosts (`plan(hosts=N, link=...)`, `slidedp plan --nodes N --link ...`): each
host's ranks share its links, DRAM and cores; collectives between hosts cross the link; every host
layer is delivered sharded and reduced on the GPUs; host figures are per host."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import slidedp
from slidedp.costmodel import memory as mem
from slidedp.costmodel import ops
from slidedp.costmodel.hardware import LINKS, PRESETS
from slidedp.scheduler.decisions import SolverOptions

SHORT = SolverOptions(deterministic_time=0.2)
KW = dict(batch_size=1, seq_len=2048, hardware="h100-sxm", solver_options=SHORT)


@pytest.fixture(scope="module")
def model():
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg)


def test_collectives_across_hosts_are_set_by_the_slower_of_the_two_rings():
    hw, nbytes = PRESETS["h100-sxm"], 1e9
    within = ops.all_gather_time_s(nbytes, 4, hw)  # one host of 4
    assert ops.all_gather_time_s(nbytes, 8, hw, hosts=2, link_bytes_per_s=1e15) == pytest.approx(within)
    slow = ops.reduce_scatter_time_s(nbytes, 8, hw, hosts=2, link_bytes_per_s=25e9)
    assert slow == pytest.approx(0.5 * nbytes / 25e9)  # half the layer crosses each host's link
    with pytest.raises(ValueError, match="link"):
        ops.all_gather_time_s(nbytes, 8, hw, hosts=2)


def test_two_hosts_route_every_layer_sharded_and_reduce_on_the_gpus(model):
    # three blocks' state on the devices (a full copy on every rank: several hosts keep it whole): the rest
    # streamed
    kw = {**KW, "solver_options": SolverOptions(deterministic_time=0.2, device_state_blocks=3)}
    plan = slidedp.plan(model, "2GiB", world_size=8, hosts=2, link="ib-4x400", **kw)
    assert plan.device_state == (1, 2, 3) and not plan.device_state_sharded
    assert plan.workload.hosts == 2 and plan.workload.link_bytes_per_s == LINKS["ib-4x400"]
    streamed = [d for d in plan.decisions if d.layer_id not in plan.device_state]
    assert streamed and {(d.delivery, d.reduction) for d in streamed} == {("sharded", "gpu")}
    text = plan.summary()
    assert "over 2 hosts of 4" in text and "host memory per host" in text and "2 hosts of 4 rank(s)" in text
    plan.validate()
    one_host = slidedp.plan(model, "2GiB", world_size=8, **kw)  # the same three blocks on the devices
    # per host: the chunks its 4 ranks own (as the runtime lays them out, for the host holding the
    # most), the pinned staging of 4 ranks instead of 8
    layers = [(d.numel, d.chunks, d.owners) for d in plan.decisions]
    on_device = {i for i, d in enumerate(plan.decisions) if d.layer_id in plan.device_state}
    elem = 2 if plan.workload.precision == "bf16" else 4
    per_host = [mem.host_state_bytes(mem.host_held_numels(layers, 8, 2, h, whole=on_device), elem,
                                     control_ints=mem.step_flag_ints(4, len(layers))) for h in range(2)]
    assert plan.host_memory["state"] == max(per_host)
    whole = mem.host_state_bytes([d.numel for d in plan.decisions], elem,
                                 control_ints=mem.step_flag_ints(4, len(layers)))
    on_device_bytes = mem.host_state_bytes([plan.decisions[i].numel for i in on_device], elem)
    assert plan.host_memory["state"] <= whole / 2 + on_device_bytes / 2 + (1 << 20)
    assert plan.host_memory["state"] < one_host.host_memory["state"]
    # the pinned gradient staging of the ranks of one host: 4 here, 8 on the one host (largest chunk each)
    for p, ranks in ((plan, 4), (one_host, 8)):
        largest = max(-(-d.numel // d.chunks) for d in p.decisions if d.layer_id not in p.device_state)
        assert p.host_memory["pinned_buffers"] == mem.host_staging_bytes(largest, elem, ranks)


def test_a_slower_link_never_gives_a_faster_step(model):
    steps = [slidedp.plan(model, "2GiB", world_size=4, hosts=2, link=link, **KW).predicted_step_time_s
             for link in ("ib-8x400", "eth-2x100", "eth-1x25")]
    assert steps[0] <= steps[1] <= steps[2] and steps[2] > steps[0]


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=4, hosts=2), "say the link between them"),
    (dict(world_size=6, hosts=4, link="ib-4x400"), "not a whole number of ranks per host"),
    (dict(world_size=4, hosts=2, link="infiniband"), "link must be one of"),
    (dict(world_size=4, hosts=2, link=-1.0), "link must be one of"),
])
def test_bad_hosts_or_links_are_refused(model, kwargs, words):
    with pytest.raises(ValueError, match=words):
        slidedp.plan(model, "2GiB", **{**KW, **kwargs})


def test_a_plan_for_one_host_is_refused_on_two(model, tmp_path):
    from slidedp.api import check_plan_matches, trace
    from slidedp.api import check_request

    plan = slidedp.plan(model, "2GiB", world_size=4, **KW)
    request = check_request(model, "2GiB", batch_size=1, seq_len=2048, world_size=4, device="cpu", precision="bf16",
                            optimizer=None, max_grad_norm=None, hardware="h100-sxm", micro_batches=1,
                            compile_blocks=True, planning_only=True, hosts=2, link="ib-4x400")
    with pytest.raises(ValueError, match="hosts is 1 in the plan but 2 here"):
        check_plan_matches(plan, trace(request, plan), world_size=4, precision="bf16", hosts=2)


def test_the_cli_plans_for_several_nodes(model, tmp_path, capsys):
    from slidedp.cli import main

    out = tmp_path / "plan.json"
    code = main(["plan", "llama-tiny", "--budget", "1GiB", "--batch-size", "1", "--seq-len", "64", "--world-size", "4",
                 "--nodes", "2", "--link", "eth-2x100", "--hardware", "h100-sxm", "--out", str(out)])
    assert code == 0
    plan = slidedp.Plan.load(out)
    assert plan.workload.hosts == 2 and plan.workload.link_bytes_per_s == LINKS["eth-2x100"]


def test_qwen25_72b_on_4_hosts_of_4_rtx4090_plans_with_streamed_tables():
    """With resident tables the floor is above 24 GiB; streamed by vocabulary chunk on the sharded / gpu
    routes (docs/design.md §4.14) the shape plans there (benchmarks/known_plans)."""
    import transformers

    from slidedp.train.shapes import preset_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(preset_config("qwen2.5-72b")).to(torch.bfloat16)
    kw = dict(batch_size=1, seq_len=4096, world_size=16, hosts=4, link="eth-1x100", hardware="rtx4090",
              precision="bf16", host_memory="512GiB", compile_blocks=True, max_grad_norm=1.0)
    with pytest.raises(slidedp.InfeasibleBudgetError) as resident:
        slidedp.plan(model, "24GiB", solver_options=SolverOptions(vocab_streamed=()), **kw)
    assert resident.value.min_budget_bytes > 24 * 2**30
    plan = slidedp.plan(model, "24GiB", **kw)
    edges = [d for d in plan.decisions if d.kind != "block"]
    # a table streams (offloaded block inputs, recompute_offload, may leave room for the other's)
    assert {(d.delivery, d.reduction) for d in edges} == {("sharded", "gpu")}
    assert any(d.activation == "streamed" for d in edges)
    assert plan.peak_device_bytes <= 24 * 2**30 and plan.peak_host_bytes <= 512 * 2**30
    plan.validate()
