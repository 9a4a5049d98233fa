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
36-block model would take ~18 s. Only the first `max_traced_blocks` blocks are exported as
themselves; the others are swapped, for the duration of the export only, for stand-ins that clone
the hidden state (one node each). Their group has `traced=False`, n_nodes=1 and no FLOPs (the block
costs come from `build.py`'s per-block FakeTensor trace anyway), but count and order are checked for
every block. Export failures of any kind return None with the reason; they never break the build.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from slidedp.ir.blocks import BlockCall, get_submodule_parent, wrap_block_output

MAX_TRACED_BLOCKS = 3

# composite ops that the pre-dispatch (training) IR keeps and FlopCounterMode sees decomposed
_FLOP_OPS = {str(p) for p in flop_registry} | {
    "aten.linear", "aten.matmul", "aten.scaled_dot_product_attention", "aten.einsum", "aten.bilinear",
    "aten.conv1d", "aten.conv2d", "aten.conv3d",
}
_TRIVIAL = re.compile(r"^(aten\._assert|aten\.sym_|aten\._local_scalar_dense|getitem$|aten\.alias)")


@dataclass(frozen=True)
class OpGroup:
    name: str  # "prologue" | "{blocks_path}.{i}" | "epilogue"
    n_nodes: int
    flops: float = 0.0  # forward FLOPs of the group's ops on the export inputs
    own_ops: tuple[str, ...] = ()  # ops run by the model's own forward (prologue/epilogue)
    traced: bool = True  # False: a stand-in block (see the module docstring)


@dataclass(frozen=True)
class ExportGroups:
    prologue: OpGroup
    blocks: tuple[OpGroup, ...]  # in the order the graph runs them
    epilogue: OpGroup
    block_order: tuple[int, ...]  # block indices as the graph runs them (consecutive nodes merged)
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
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


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
        swapped = nn.ModuleList(
            original[i] if i < max_traced_blocks else _StandIn(block_output) for i in range(len(original))
        )
        parent._modules[attr] = swapped
        try:
            program = torch.export.export(model, (ids,), kwargs, strict=False)
        finally:
            parent._modules[attr] = original
        groups = _group(program.graph, blocks_path, n_blocks, max_traced_blocks)
    except Exception as exc:  # noqa: BLE001 - export failure only means falling back
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return ExportGroups(**groups, seconds=time.perf_counter() - start), ""


def export_layer_groups(model, blocks_path, n_blocks, batch_size, seq_len, **kw) -> ExportGroups | None:
    return export_layer_groups_or_reason(model, blocks_path, n_blocks, batch_size, seq_len, **kw)[0]


def _accepts(model: nn.Module, name: str) -> bool:
    from slidedp.ir.build import forward_kwargs  # lazy: build imports this module

    return name in forward_kwargs(model)


def _group(graph: torch.fx.Graph, blocks_path: str, n_blocks: int, max_traced: int) -> dict:
    block_re = re.compile(re.escape(blocks_path) + r"\.(\d+)$")
    # the model's own forward: the root and the containers of the block list ("", "model", ...)
    own_paths = {""} | {blocks_path.rsplit(".", k)[0] for k in range(1, blocks_path.count(".") + 1)}

    nodes = [n for n in graph.nodes if n.op == "call_function"]
    block_of: dict[torch.fx.Node, int] = {}
    innermost: dict[torch.fx.Node, str] = {}
    for n in nodes:
        paths = [p for p, _cls in (n.meta.get("nn_module_stack") or {}).values()]
        innermost[n] = paths[-1] if paths else ""
        for p in paths:
            m = block_re.match(p)
            if m:
                block_of[n] = int(m.group(1))
                break
    if not block_of:
        raise RuntimeError(f"no exported node ran inside {blocks_path}")
    positions = [i for i, n in enumerate(nodes) if n in block_of]
    first, last = positions[0], positions[-1]

    order: list[int] = []
    members: dict[int, list[torch.fx.Node]] = {}
    for n in nodes[first : last + 1]:
        if n in block_of:
            b = block_of[n]
            if not order or order[-1] != b:
                order.append(b)
            members.setdefault(b, []).append(n)

    # ops outside the blocks whose inputs come from a block: they would change the hidden state
    on_path = set(block_of)
    between = []
    for n in nodes[first : last + 1]:
        if n not in block_of and any(a in on_path for a in n.all_input_nodes):
            on_path.add(n)
            if not _TRIVIAL.match(op_name(n.target)):
                between.append(op_name(n.target))

    def own(ns):
        return tuple(
            op_name(n.target) for n in ns
            if innermost[n] in own_paths and not _TRIVIAL.match(op_name(n.target))
        )

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

    fake_mode = next((v.fake_mode for n in todo for v in [n.meta.get("val")] if isinstance(v, FakeTensor)), None)
    if fake_mode is None:
        return 0.0
    with fake_mode, FlopCounterMode(display=False) as counter:
        for n in todo:
            n.target(*tree_map(val, n.args), **tree_map(val, n.kwargs))
    return float(counter.get_total_flops())


__all__ = ["ExportGroups", "OpGroup", "export_layer_groups", "export_layer_groups_or_reason", "op_name",
           "MAX_TRACED_BLOCKS"]
