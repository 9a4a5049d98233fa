"""Optimizer state kept on the device for some blocks (plan.device_state): the same training as
torch.optim.AdamW, checkpoints and state_dict see it, and the planner chooses it only where it pays."""

import copy

import pytest
import torch

import slidedp
from slidedp.costmodel import memory as mem
from slidedp.costmodel.hardware import PRESETS
from slidedp.ir.build import build_layer_graph
from slidedp.run.preflight import host_state_bytes
from slidedp.scheduler.decisions import SolverOptions
from slidedp.scheduler.solve import solve_plan
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD, random_batch, train_side_by_side
from tests.models import make_model

GiB = 2**30


def device_state_plan(model, blocks: int, *, micro_batches: int = 2, budget=GiB, prologue: bool = False):
    graph = build_layer_graph(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=torch.float32)
    return solve_plan(graph, budget_bytes=budget, hardware=PRESETS["cpu"], precision="fp32",
                      micro_batches=micro_batches,
                      options=SolverOptions(device_state_blocks=blocks, device_state_prologue=prologue))


def compiled(model, plan, **kw):
    return slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                           optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP, plan=plan, **kw)


@pytest.mark.parametrize("family, tied, blocks, prologue", [
    ("llama", False, 2, False), ("gpt2", True, 3, False), ("qwen3", False, 1, False),
    ("llama", False, 2, True),  # the embedding's state on the device, the head's on the host
    ("gpt2", True, 1, True),  # a tied head: the head reads the prologue's weight, copied within the device
    ("qwen3", False, 4, True),  # every layer: 3 blocks and the epilogue, nothing left for the CPU
    ("gpt2", True, 4, False),  # the epilogue (final norm) without the prologue
])
def test_device_state_is_exact(family, tied, blocks, prologue):
    model = make_model(family, tied=tied)
    ref = copy.deepcopy(model).eval()
    plan = device_state_plan(model, blocks, prologue=prologue)
    assert plan.device_state == tuple(range(0 if prologue else 1, blocks + 1))
    assert plan.memory["device_state_bytes"] > 0 and "optimizer state on the device" in plan.summary()
    assert slidedp.Plan.from_dict(plan.to_dict()) == plan
    with compiled(model, plan) as engine:
        assert engine.runner.device_state is not None
        assert set(engine.runner.updates.order).isdisjoint(plan.device_state)  # the CPU skips them
        assert_nothing_on_the_host(engine, plan)
        full = host_state_bytes(engine.graph, precision="fp32", control_ints=engine.host.control_ints)
        assert engine.host.nbytes == host_state_bytes(engine.graph, precision="fp32", lean_layers=plan.device_state,
                                                      control_ints=engine.host.control_ints) < full
        train_side_by_side(engine, ref, steps=3, seed=11)


@pytest.mark.parametrize("family, tied, layers", [
    ("llama", False, (2,)),  # a middle block alone
    ("qwen3", False, (1, 3)),  # blocks with a host block between them
    ("gpt2", True, (0, 2)),  # the embedding (the tied head's weight) and a later block
    ("llama", False, (3, 4)),  # the last block and the epilogue, the first blocks on the host
])
def test_any_set_of_layers_keeps_its_state_on_the_device(family, tied, layers):
    """The planner places the state per layer (not only a prefix): a plan naming any set trains
    exactly like torch.optim.AdamW, and the host keeps nothing of those layers."""
    model = make_model(family, tied=tied)
    ref = copy.deepcopy(model).eval()
    host_plan = device_state_plan(model, 0)
    assert host_plan.device_state == ()
    plan = host_plan.replace(device_state=layers)
    assert not plan.problems()
    with compiled(model, plan) as engine:
        assert set(engine.runner.updates.order).isdisjoint(layers)
        assert_nothing_on_the_host(engine, plan)
        train_side_by_side(engine, ref, steps=3, seed=12)


def assert_nothing_on_the_host(engine, plan):
    """Lean: the host state allocates no byte for the layers on the device (the arrays' specs and
    views are empty, and the file holds only the other layers' arrays and the control region)."""
    host = engine.host
    for i in plan.device_state:
        layout, arrays = host.layouts[i], host.layers[i]
        assert layout.lean and layout.numel > 0
        specs = [layout.master, layout.exp_avg, layout.exp_avg_sq, layout.grad] + (
            [layout.delivery] if layout.delivery is not None else [])
        assert all(spec.nbytes == 0 for spec in specs) and layout.spare is None
        assert all(t.numel() == 0 for t in (arrays.master, arrays.exp_avg, arrays.exp_avg_sq, arrays.grad, arrays.source))
    elem = 4 if engine.precision == "fp32" else 2
    others = sum(mem.host_layer_bytes(layer.numel, elem) for layer in engine.graph.layers
                 if layer.id not in plan.device_state)
    assert host.nbytes == others + mem._page(host.control_ints * 8)
    for i in plan.device_state:  # the model's parameters view the device's master
        d = engine.runner.device_state.layers[i].master
        for name in engine.host.layers[i].param_views(d):
            p = engine.model.get_parameter(name)
            assert p.dtype == torch.float32 and d.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()


def test_gradient_accumulation_over_passes_and_checkpoint_round_trip(tmp_path):
    """Two passes per step (the device gradient is added to), then a checkpoint saved mid-run and
    loaded into a fresh engine continues exactly like the uninterrupted one."""
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    plan = device_state_plan(model, 2, micro_batches=1)  # 2 rows per step: two passes of one micro-batch
    with compiled(model, plan) as engine:
        train_side_by_side(engine, ref, steps=2, seed=3)
        engine.save_checkpoint(tmp_path / "ckpt")
        gen = torch.Generator().manual_seed(99)
        batches = [random_batch(gen, 2 * BATCH) for _ in range(2)]
        losses = [engine.step(*b) for b in batches]
        final = engine.state_dict()
    fresh = make_model("llama", seed=1)  # other weights: everything must come from the checkpoint
    with compiled(fresh, plan) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert [engine.step(*b) for b in batches] == losses
        resumed = engine.state_dict()
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


def test_close_leaves_the_trained_weights_in_the_model():
    model = make_model("qwen3")
    plan = device_state_plan(model, 3)
    engine = compiled(model, plan)
    gen = torch.Generator().manual_seed(0)
    engine.step(*random_batch(gen, 2 * BATCH))
    state = engine.state_dict()
    engine.close()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), state[name]), name


def test_planner_keeps_state_on_the_device_where_it_pays():
    """On an H200 profile with a spare budget the planner (the CP-SAT model, per layer) puts the state
    of some layers on the device and predicts a shorter step than with none, for several ranks too
    where the GPUs reach each other; on the CPU profile (no device bandwidth figure) and for several
    GPUs without peer-to-peer it never does; a fixed count beyond the blocks and the epilogue is refused."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    graph = build_layer_graph(model, batch_size=1, seq_len=2048)
    kw = dict(budget_bytes=20 * GiB, hardware=PRESETS["h200-sxm"], compiled_blocks=True)

    def options(**fixed):  # a short CP-SAT search
        return SolverOptions(deterministic_time=0.1, **fixed)

    chosen = solve_plan(graph, **kw, options=options())
    none = solve_plan(graph, **kw, options=options(device_state_blocks=0))
    blocks_only = solve_plan(graph, **kw, options=options(device_state_prologue=False))
    assert chosen.device_state and none.device_state == () and 0 not in blocks_only.device_state
    assert max(chosen.predicted_step_time_s, blocks_only.predicted_step_time_s) < none.predicted_step_time_s
    assert "optimizer state on the device" in chosen.solver["searches"]
    assert "the prologue's fixed" in blocks_only.solver["searches"]["optimizer state on the device"]
    assert none.solver["searches"]["optimizer state on the device"] == "fixed by SolverOptions.device_state_blocks"
    alternative = next(a for a in chosen.alternatives if a.decision == "optimizer state on the device")
    assert alternative.runner_up_step_s is None or alternative.runner_up_step_s >= chosen.predicted_step_time_s
    assert chosen.peak_device_bytes <= 20 * GiB
    assert solve_plan(graph, **{**kw, "hardware": PRESETS["cpu"]}, options=options()).device_state == ()
    two = solve_plan(graph, **kw, world_size=2, options=options())
    assert two.device_state and two.predicted_step_time_s < solve_plan(
        graph, **kw, world_size=2, options=options(device_state_blocks=0)).predicted_step_time_s
    assert solve_plan(graph, **{**kw, "hardware": PRESETS["rtx4090"]}, world_size=2, options=options()).device_state == ()
    with pytest.raises(ValueError, match="blocks"):
        solve_plan(graph, **kw, options=SolverOptions(device_state_blocks=10))


def test_weights_from_a_folder_or_a_function_go_straight_to_the_device(tmp_path):
    """A meta-device model whose weights come from a sharded safetensors folder (read a slab of rows
    at a time) or a function (filling the device's master): nothing of the device layers on the host,
    and training is exact."""
    import accelerate

    source = make_model("qwen3")
    source.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    values = {name: p.detach().clone() for name, p in source.named_parameters()}
    plan = device_state_plan(source, 3, prologue=True)

    def empty():
        with accelerate.init_empty_weights():
            return type(source)(source.config)

    def fill(name, out):
        assert out.dtype == torch.float32 and out.shape == values[name].shape
        out.copy_(values[name])

    for weights in (tmp_path, fill):
        ref = copy.deepcopy(source).eval()
        with compiled(empty(), plan, weights=weights) as engine:
            assert_nothing_on_the_host(engine, plan)
            train_side_by_side(engine, ref, steps=2, seed=4)


def test_rows_of_a_tensor_are_read_a_slab_at_a_time(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from slidedp.run.weights import read_rows_into

    value = torch.randn(37, 5, dtype=torch.bfloat16)
    save_file({"w": value, "s": torch.tensor(2.5)}, tmp_path / "x.safetensors")
    out, scalar = torch.empty(37, 5), torch.empty(())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as reader:
        read_rows_into(out, reader, "w", piece_bytes=3 * 5 * 4)  # 3 rows a slab: 13 slabs
        read_rows_into(scalar, reader, "s", piece_bytes=1)
    assert torch.equal(out, value.float()) and float(scalar) == 2.5


def test_staging_moves_pieces_through_one_bounded_buffer():
    """The staged path (what a GPU takes), run on the CPU: every piece goes through the buffer."""
    from slidedp.backend.state.staging import copy_in_pieces_, pieces_from, pieces_into, to_host

    src = torch.randn(1000)
    seen, ptrs = [], set()
    for lo, hi, piece in pieces_from(src, piece_bytes=256, staged=True):  # 64 fp32 a piece
        assert piece.numel() == hi - lo <= 64
        ptrs.add(piece.data_ptr())
        seen.append(piece.clone())
    assert len(ptrs) == 1 and torch.equal(torch.cat(seen), src)
    dst = torch.empty(1000)
    for lo, hi, piece in pieces_into(dst, piece_bytes=256, staged=True):
        piece.copy_(src[lo:hi])
    assert torch.equal(dst, src)
    half = torch.empty(10, 100)
    copy_in_pieces_(half, src.bfloat16(), piece_bytes=100, staged=True)
    assert torch.equal(half.view(-1), src.bfloat16().float())
    assert torch.equal(to_host(src, torch.bfloat16, piece_bytes=40), src.bfloat16())


def test_checkpoints_are_interchangeable_with_engines_without_device_state(tmp_path):
    """A device-state engine's checkpoint (its device layers streamed into the same files) loads into
    an engine that keeps everything on the host and goes on bitwise, and the other way round; the
    master weights read from the files alone are the state_dict."""
    from slidedp.run.checkpoint import read_master_weights

    model = make_model("llama")
    on_device, on_host = device_state_plan(model, 2, prologue=True), device_state_plan(model, 0)
    gen = torch.Generator().manual_seed(7)
    warm = [random_batch(gen, 2 * BATCH) for _ in range(2)]
    later = [random_batch(gen, 2 * BATCH) for _ in range(2)]
    for first, second in ((on_device, on_host), (on_host, on_device)):
        with compiled(make_model("llama"), first) as engine:
            for b in warm:
                engine.step(*b)
            engine.save_checkpoint(tmp_path / "ck")
            assert all(torch.equal(read_master_weights(tmp_path / "ck")[k], v) for k, v in engine.state_dict().items())
            losses = [engine.step(*b) for b in later]
            final = engine.state_dict()
        with compiled(make_model("llama", seed=1), second) as engine:
            engine.load_checkpoint(tmp_path / "ck")
            assert [engine.step(*b) for b in later] == losses
            resumed = engine.state_dict()
        assert all(torch.equal(resumed[k], v) for k, v in final.items())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_writes_the_device_layers_weights(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = make_model("qwen3", tied=True)
    plan = device_state_plan(model, 4, prologue=True)  # every layer's state on the device
    with compiled(model, plan) as engine:
        gen = torch.Generator().manual_seed(2)
        engine.step(*random_batch(gen, 2 * BATCH))
        state = engine.state_dict()
        engine.export_hf(tmp_path / "hf", dtype=dtype)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    to = torch.float32 if dtype == "fp32" else torch.bfloat16
    for name, p in loaded.named_parameters():
        assert torch.equal(p, state[name].to(to).float()), name
