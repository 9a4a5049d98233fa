"""The torch.fx view of a model: `torch.export(strict=False)` grouped into prologue / blocks / epilogue.

The exported graph's call_function nodes carry `nn_module_stack`; a node belongs to block i when its
stack holds `{blocks_path}.{i}`; nodes before the first block node form the prologue, after the last
one the epilogue. What this adds to the module-structure discovery of `build.py`:

- the ops the model's *own* forward runs (the root module or a container of the blocks, not a child
  module): GPT-2's position ids and `wte + wpe` add, an embedding scaling `* dim**0.5`, mask code;
- a check that the blocks run once each, in order, chained directly: an op outside any block on the
  hidden-state path between two blocks (`x = x * 2` between blocks) is reported in `between_ops`,
  since slidedp's executor chains the blocks itself and would silently skip it;
- node counts and FLOPs per group.

Export runs on fake tensors (non-strict export fakifies the parameters; inputs are placed on the
parameters' device, so models on the meta device work too) and never allocates weights.

Speed: export costs a few ms per graph node, about 0.5 s per decoder block of an 8B model, so a
36-block model would take ~18 s. Only the first `max_traced_blocks` blocks (default 1) are exported
as themselves; the others are swapped, for the duration of the export only, for stand-ins that clone
the hidden state (one node each). Their group has `traced=False`, n_nodes=1 and no FLOPs (the block
costs come from `build.py`'s per-block FakeTensor trace anyway), but count and order are checked for
every block. Export failures of any kind return None with the reason; they never break the build.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from slidedp.ir.blocks import BlockCall, forward_kwargs, get_submodule_parent, wrap_block_output

MAX_TRACED_BLOCKS = 1  # exported as themselves; later blocks are stand-ins (speed)

_aten = torch.ops.aten


def attention_flops(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int],
                    is_causal: bool, backward: bool) -> int:
    """FLOPs of SDPA on [b, h, s, d] tensors of these shapes, counted as FlopCounterMode's registry counts them (2 per
    multiply-add of each matmul: forward 2 b h s_q s_k (d + d_v), backward the scores again and four
    gradient matmuls, 2 b h s_q s_k (3 d + 2 d_v)), with h the query heads (grouped-query attention,
    which some torch versions' formulas refuse, costs what its query heads do), halved when causal
    (queries and keys of the same length: half the pairs, which is what the GPU's flash kernels skip)."""
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    flops = 2 * b * h * s_q * s_k * ((3 * d + 2 * d_v) if backward else (d + d_v))
    return flops // 2 if is_causal and s_q == s_k else flops


def _flash_cpu_forward_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    return attention_flops(query.shape, key.shape, value.shape, bool(is_causal), backward=False)


def _flash_cpu_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False,
                              *args, **kwargs) -> int:
    return attention_flops(query.shape, key.shape, value.shape, bool(is_causal), backward=True)


_flash_cpu_forward_flops._get_raw = True  # tensors in, not shapes: FlopCounterMode must not re-wrap
_flash_cpu_backward_flops._get_raw = True


def grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int], *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul (aten._grouped_mm: mixture-of-experts layers), 2 per multiply-add, each
    row of a group multiplied by its group's matrix: [M, K] x [G, K, N] (rows split by group) and
    [M, K] x [K, N] split along K (a weight's gradient) are 2 M K N; [G, M, K] x [K, N] split along N is
    2 M K N; [G, M, K] x [G, K, N] is 2 G M K N."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 3:
        return 2 * a_shape[1] * a_shape[2] * b_shape[-1]
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


# FLOP formulas FlopCounterMode lacks: the CPU flash-attention kernels that SDPA dispatches to on
# CPU (and on fake CPU tensors), without which a block's attention FLOPs count as zero; grouped
# matmuls, without which a mixture-of-experts block's experts count as zero.
EXTRA_FLOP_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_forward_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flops,
    **({_aten._grouped_mm: grouped_mm_flops} if hasattr(_aten, "_grouped_mm") else {}),
}

# composite ops that the pre-dispatch (training) IR keeps and FlopCounterMode sees decomposed
_FLOP_OPS = {str(p) for p in (*flop_registry, *EXTRA_FLOP_FORMULAS)} | {
    "aten.linear", "aten.matmul", "aten.scaled_dot_product_attention", "aten.einsum", "aten.bilinear",
    "aten.conv1d", "aten.conv2d", "aten.conv3d",
}
# no compute: assertions, symbolic sizes, views, casts; left out of the op lists
_TRIVIAL = re.compile(
    r"^(aten\._assert|aten\.sym_|aten\._local_scalar_dense|getitem$|aten\.(alias|view|_unsafe_view|reshape|"
    r"unsqueeze|squeeze|expand|slice|select|permute|transpose|t|detach|flatten|unflatten|contiguous|to)\.)"
)


@dataclass(frozen=True)
class OpGroup:
    name: str  # "prologue" | "{blocks_path}.{i}" | "epilogue"
    n_nodes: int
    flops: float = 0.0  # forward FLOPs of the group's ops on the export inputs
    # ops run by the model's own forward (prologue/epilogue), each distinct string once, with the
    # child modules feeding them: "aten.mul.Tensor(tok)"; views, casts and assertions left out
    own_ops: tuple[str, ...] = ()
    traced: bool = True  # False: a stand-in block (see the module docstring)


@dataclass(frozen=True)
class ExportGroups:
    prologue: OpGroup
    blocks: tuple[OpGroup, ...]  # in the order the graph runs them
    epilogue: OpGroup
    block_order: tuple[int, ...]  # block index of each block call, in the order the graph runs them
    between_ops: tuple[str, ...]  # ops outside the blocks on the hidden path between two blocks
    seconds: float

    @property
    def forward_ops(self) -> tuple[str, ...]:
        return tuple(f"prologue:{o}" for o in self.prologue.own_ops) + tuple(
            f"epilogue:{o}" for o in self.epilogue.own_ops
        )


class _StandIn(nn.Module):
    """Replaces a block during export: returns a clone of its hidden-state input."""

    def __init__(self, block_output: str):
        super().__init__()
        self.block_output = block_output

    def forward(self, *args, **kwargs):
        return wrap_block_output(BlockCall(args, kwargs).hidden.clone(), self.block_output)


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def export_layer_groups_or_reason(
    model: nn.Module,
    blocks_path: str,
    n_blocks: int,
    batch_size: int,
    seq_len: int,
    *,
    block_output: str = "tensor",
    max_traced_blocks: int = MAX_TRACED_BLOCKS,
) -> tuple[ExportGroups | None, str]:
    """Export `model` and group its nodes; returns (groups, "") or (None, why export failed)."""
    start = time.perf_counter()
    try:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        kwargs = {"use_cache": False} if _accepts(model, "use_cache") else {}
        parent, attr = get_submodule_parent(model, blocks_path)
        original = parent._modules[attr]
        if len(original) != n_blocks:
            raise ValueError(f"{blocks_path} holds {len(original)} blocks, not {n_blocks}")
        swapped = nn.ModuleList(
            original[i] if i < max_traced_blocks else _StandIn(block_output) for i in range(len(original))
        )
        parent._modules[attr] = swapped
        try:
            program = torch.export.export(model, (ids,), kwargs, strict=False)
        finally:
            parent._modules[attr] = original
        groups = _group(program.graph, blocks_path, max_traced_blocks)
    except Exception as exc:  # noqa: BLE001 - export failure only means falling back
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return ExportGroups(**groups, seconds=time.perf_counter() - start), ""


def export_layer_groups(model, blocks_path, n_blocks, batch_size, seq_len, **kw) -> ExportGroups | None:
    return export_layer_groups_or_reason(model, blocks_path, n_blocks, batch_size, seq_len, **kw)[0]


def _accepts(model: nn.Module, name: str) -> bool:
    return name in forward_kwargs(model)


def _group(graph: torch.fx.Graph, blocks_path: str, max_traced: int) -> dict:
    block_re = re.compile(re.escape(blocks_path) + r"\.(\d+)$")
    # the model's own forward: the root and the containers of the block list ("", "model", ...)
    own_paths = {""} | {blocks_path.rsplit(".", k)[0] for k in range(1, blocks_path.count(".") + 1)}

    nodes = [n for n in graph.nodes if n.op == "call_function"]
    block_of: dict[torch.fx.Node, int] = {}
    call_of: dict[torch.fx.Node, str] = {}  # stack key of the block call: "...trunk.1@1" on a 2nd call
    innermost: dict[torch.fx.Node, str] = {}
    for n in nodes:
        stack = (n.meta.get("nn_module_stack") or {}).items()
        innermost[n] = list(stack)[-1][1][0] if stack else ""
        for key, (path, _cls) in stack:
            if m := block_re.match(path):
                block_of[n], call_of[n] = int(m.group(1)), key
                break
    if not block_of:
        raise RuntimeError(f"no exported node ran inside {blocks_path}")
    positions = [i for i, n in enumerate(nodes) if n in block_of]
    first, last = positions[0], positions[-1]

    order: list[int] = []
    members: dict[int, list[torch.fx.Node]] = {}
    call = None
    for n in nodes[first : last + 1]:
        if n in block_of:
            if call_of[n] != call:
                call = call_of[n]
                order.append(block_of[n])
            members.setdefault(block_of[n], []).append(n)

    # ops outside the blocks whose inputs come from a block: they would change the hidden state
    on_path = set(block_of)
    between = []
    for n in nodes[first : last + 1]:
        if n not in block_of and any(a in on_path for a in n.all_input_nodes):
            on_path.add(n)
            if not _TRIVIAL.match(op_name(n.target)):
                between.append(op_name(n.target))

    def sources(n, seen) -> list[str]:
        """Child modules whose outputs reach `n` directly or through views and casts."""
        out = []
        for a in n.all_input_nodes:
            if a.op != "call_function" or a in seen:
                continue
            seen.add(a)
            if innermost[a] not in own_paths:
                out.append(innermost[a])
            elif _TRIVIAL.match(op_name(a.target)):
                out += sources(a, seen)
        return list(dict.fromkeys(out))

    def own(ns):  # "aten.add.Tensor(transformer.wte,transformer.wpe)", each op string once
        ops = (
            op_name(n.target) + (f"({','.join(src)})" if (src := sources(n, set())) else "")
            for n in ns if innermost[n] in own_paths and not _TRIVIAL.match(op_name(n.target))
        )
        return tuple(dict.fromkeys(ops))

    pro, epi = nodes[:first], nodes[last + 1 :]
    return dict(
        prologue=OpGroup("prologue", len(pro), _flops(pro), own(pro)),
        blocks=tuple(
            OpGroup(f"{blocks_path}.{b}", len(members[b]), _flops(members[b]), (), b < max_traced)
            for b in dict.fromkeys(order)
        ),
        epilogue=OpGroup("epilogue", len(epi), _flops(epi), own(epi)),
        block_order=tuple(order),
        between_ops=tuple(between),
    )


def _flops(nodes: list[torch.fx.Node]) -> float:
    """Forward FLOPs of `nodes`: their matmul-like ops re-run on the recorded fake values."""
    todo = [n for n in nodes if isinstance(n.target, torch._ops.OpOverload)
            and str(n.target.overloadpacket) in _FLOP_OPS]
    if not todo:
        return 0.0

    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    vals = (n.meta.get("val") for n in todo)
    fake_mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if fake_mode is None:
        return 0.0
    with fake_mode, FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        for n in todo:
            n.target(*tree_map(val, n.args), **tree_map(val, n.kwargs))
    return float(counter.get_total_flops())


__all__ = ["EXTRA_FLOP_FORMULAS", "MAX_TRACED_BLOCKS", "ExportGroups", "OpGroup", "export_layer_groups",
           "export_layer_groups_or_reason", "op_name"]
