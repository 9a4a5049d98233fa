"""The layer IR of every supported family: structure, parameters, costs, export grouping, errors."""

import dataclasses
import resource
import time

import networkx as nx
import pytest
import torch
from torch import nn

from slidedp.errors import UnsupportedModelError
from slidedp.ir.build import build_layer_graph
from slidedp.ir.export_trace import export_layer_groups
from slidedp.ir.graph import BLOCK, EPILOGUE, PROLOGUE
from tests.models import FAMILIES, PlainLM, make_model

B, S = 2, 16
CASES = [(f, t) for f in FAMILIES for t in (False, True)]
_cache: dict = {}


def built(family: str, tied: bool):
    if (family, tied) not in _cache:
        model = make_model(family, tied)
        _cache[family, tied] = model, build_layer_graph(model, batch_size=B, seq_len=S)
    return _cache[family, tied]


@pytest.mark.parametrize("family,tied", CASES)
def test_layers_params_and_costs(family, tied):
    model, g = built(family, tied)
    blocks_before = model.get_submodule(g.blocks_path)
    assert [layer.kind for layer in g.layers] == [PROLOGUE] + [BLOCK] * 3 + [EPILOGUE]
    assert [layer.id for layer in g.layers] == list(range(5))
    assert [b.name for b in g.blocks] == [f"{g.blocks_path}.{i}" for i in range(3)]
    assert g.trace_method == "export" and g.forward_ops
    assert model.get_submodule(g.blocks_path) is blocks_before  # nothing swapped for good

    # every trainable parameter stored exactly once
    stored = [p for layer in g.layers for p in layer.params]
    assert len({p.name for p in stored}) == len(stored)
    unique = {id(p): p for p in model.parameters() if p.requires_grad}
    assert sum(p.numel for p in stored) == sum(p.numel() for p in unique.values()) == g.numel
    names_of = {n: p.name for p in stored for n in (p.name, *p.aliases)}
    assert all(n in names_of for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)

    # tied head: stored by the prologue, named by the epilogue
    if tied:
        (tied_name,) = g.epilogue.tied_param_names
        assert tied_name in {p.name for p in g.prologue.params}
        assert isinstance(model.get_submodule(tied_name.rpartition(".")[0]), nn.Embedding)
    else:
        assert g.epilogue.tied_param_names == ()
        assert len(g.epilogue.params) >= 2  # final norm and head
    assert nx.is_directed_acyclic_graph(dag := g.dag())
    assert sum(d["kind"] == "tied" for *_, d in dag.edges(data=True)) == int(tied)

    # no_decay: norms, biases, embeddings; matrices of linear layers decay
    for p in stored:
        module = model.get_submodule(p.name.rpartition(".")[0])
        expected = (len(p.shape) < 2 or isinstance(module, nn.Embedding) or "Norm" in type(module).__name__)
        assert p.no_decay == expected, p.name

    # block costs: 2 * params * tokens + attention (QK^T and PV, 4 * tokens * S * width)
    tokens = B * S
    for block in g.blocks:
        c = block.costs
        analytic = 2 * block.numel * tokens + 4 * tokens * S * g.hidden_size
        assert c.flops_fwd == pytest.approx(analytic, rel=0.25), (c.flops_fwd, analytic)
        assert c.flops_bwd == pytest.approx(2 * c.flops_fwd, rel=0.1)
        assert c.boundary_activation_bytes == tokens * g.hidden_size * 2  # bf16
        assert c.saved_activation_bytes > c.boundary_activation_bytes


def test_fingerprint_stable_and_workload_specific():
    model, g = built("llama", True)
    again = build_layer_graph(model, batch_size=B, seq_len=S)
    assert again == g and again.fingerprint() == g.fingerprint()
    assert build_layer_graph(model, batch_size=B, seq_len=S // 2).fingerprint() != g.fingerprint()
    # another library version may trace other ops and costs: the same model, the same fingerprint
    other = dataclasses.replace(g, forward_ops=(), trace_method="module", layers=tuple(
        dataclasses.replace(layer, costs=dataclasses.replace(layer.costs, flops_fwd=layer.costs.flops_fwd * 1.1))
        for layer in g.layers))
    assert other.fingerprint() == g.fingerprint()
    renamed = dataclasses.replace(g, layers=(dataclasses.replace(g.layers[0], name="stem"),) + g.layers[1:])
    assert renamed.fingerprint() != g.fingerprint()


def test_export_finds_ops_of_the_models_own_forward():
    plain = built("plain", False)[1].forward_ops
    assert "prologue:aten.mul.Tensor(tok)" in plain  # x = tok(ids) * dim**0.5
    gpt2 = built("gpt2", False)[1].forward_ops
    assert "prologue:aten.add.Tensor(transformer.wte,transformer.wpe)" in gpt2
    assert not any("wpe" in op for op in built("llama", False)[1].forward_ops)

    model, g = built("qwen3", False)
    groups = export_layer_groups(model, g.blocks_path, 3, B, S, max_traced_blocks=3)
    assert groups.block_order == (0, 1, 2) and groups.between_ops == ()
    # export == module trace, but for attention: torch.export makes transformers pass a dense causal
    # mask (every query-key pair counted, 4 B S^2 H d), the executor none (SDPA causal: half of that)
    cfg = model.config
    half_attention = 2 * B * S * S * cfg.num_attention_heads * cfg.head_dim
    assert [b.flops for b in groups.blocks] == [b.costs.flops_fwd + half_attention for b in g.blocks]
    assert groups.epilogue.flops == 2 * B * S * g.hidden_size * g.vocab_size  # the head


def test_export_failure_falls_back_to_module_structure(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no export today")

    monkeypatch.setattr(torch.export, "export", fail)
    g = build_layer_graph(make_model("plain"), batch_size=B, seq_len=S)
    assert g.trace_method == "module" and g.forward_ops == ()
    assert len(g.blocks) == 3


def test_qwen3_8b_on_meta_device_is_fast_and_allocates_nothing():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    g = build_layer_graph(model, batch_size=1, seq_len=4096)
    seconds = time.perf_counter() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert seconds < 10, seconds
    assert grown_mb < 500, grown_mb
    assert g.trace_method == "export" and len(g.blocks) == 36
    assert g.numel == sum(p.numel() for p in model.parameters())  # ~8.2e9
    block = g.blocks[0]
    assert block.costs.flops_fwd == pytest.approx(  # weights, and causal attention: half of 4 S^2 H d
        2 * block.numel * 4096 + 2 * 4096 * 4096 * 32 * 128, rel=0.02)
    # the attention part on its own (the cost model gives it its own rate): forward QK^T and PV,
    # backward the scores again and four gradient matmuls, causal: half the pairs
    assert block.costs.attention_flops_fwd == 2 * 4096 * 4096 * 32 * 128
    assert block.costs.attention_flops_bwd == 5 * 4096 * 4096 * 32 * 128
    assert g.prologue.costs.attention_flops_fwd == g.epilogue.costs.attention_flops_bwd == 0


def test_frozen_parameters_get_no_storage():
    model = make_model("llama", tied=False)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[1].input_layernorm.weight.requires_grad_(False)
    g = build_layer_graph(model, batch_size=B, seq_len=S)
    names = {p.name for layer in g.layers for p in layer.params}
    assert "model.embed_tokens.weight" not in names
    assert "model.layers.1.input_layernorm.weight" not in names
    assert g.numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert g.prologue.params == ()


class _Reordered(PlainLM):
    def __init__(self, order, between=None):
        super().__init__()
        self.order, self.between = order, between

    def forward(self, input_ids):
        x = self.tok(input_ids)
        for k, i in enumerate(self.order):
            x = self.trunk[i](x)
            if self.between and k == 0:
                x = x * 2.0
        return self.out(self.final(x))


@pytest.mark.parametrize("order,match", [
    ((0, 2, 1), "called block 2 after 1 blocks"),
    ((0, 2), "called block 2 after 1 blocks"),
    ((0, 1), "called 2 of its 3 blocks"),
    ((0, 1, 1, 2), "called block 1 after 2 blocks"),
])
def test_blocks_out_of_order_or_skipped(order, match):
    model = _Reordered(order)
    with pytest.raises(UnsupportedModelError, match=match):
        build_layer_graph(model, batch_size=B, seq_len=S)
    assert export_layer_groups(model, "trunk", 3, B, S).block_order == order  # export sees it too


def test_ops_between_blocks_are_refused():
    with pytest.raises(UnsupportedModelError, match=r"aten.mul.Tensor.*between blocks"):
        build_layer_graph(_Reordered((0, 1, 2), between=True), batch_size=B, seq_len=S)


def test_output_without_logits_is_refused():
    class DictLM(PlainLM):
        def forward(self, input_ids):
            return {"hidden": super().forward(input_ids)}

    with pytest.raises(UnsupportedModelError, match="logits"):
        build_layer_graph(DictLM(), batch_size=B, seq_len=S)


def test_a_block_that_cannot_run_on_fake_tensors_is_refused_by_name():
    """A block whose forward branches on its data cannot be traced on fake tensors: refused as an
    unsupported model naming the block, not a bare tracing error."""
    class DataBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else x  # a Python branch on a value

    model = PlainLM()
    model.trunk = nn.ModuleList(DataBranch() for _ in range(3))
    with pytest.raises(UnsupportedModelError, match=r"tracing block trunk\.0 \(DataBranch\)"):
        build_layer_graph(model, batch_size=B, seq_len=S)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_memory_is_linear_in_sequence_length(family):
    """Without padding the executor's blocks get no dense [s, s] mask (SDPA runs causal), so what a
    block saves must not grow quadratically; tracing with fake tensors must not invent that mask."""
    model = make_model(family)
    short, long = (build_layer_graph(model, batch_size=1, seq_len=s).blocks[0].costs for s in (32, 64))
    assert long.saved_activation_bytes == 2 * short.saved_activation_bytes
    assert long.peak_workspace_bytes == 2 * short.peak_workspace_bytes


def test_attention_backward_workspace_is_counted():
    """A block's workspace holds the SDPA backward's gradients of q, k, v and the fp32 accumulator
    of q's that the GPU flash kernel allocates (grouped-query attention: fewer key/value heads)."""
    from slidedp.ir.build import AttentionWorkspace

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    with AttentionWorkspace() as workspace:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    assert workspace.bytes == q.numel() * (4 + 4) + (k.numel() + v.numel()) * 4
