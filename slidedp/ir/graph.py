"""The layer IR: frozen descriptions of a model's layers, free of torch objects.

A `LayerGraph` is an ordered tuple of `Layer`s: one prologue (embeddings and whatever the model's
forward does before its first block), the blocks, one epilogue (final norm, head, loss). Each layer
lists the parameters it stores; a parameter used by two layers (a tied head) is stored once, by the
layer that runs first, and the other layer names it in `tied_param_names`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import networkx as nx

PROLOGUE = "prologue"
BLOCK = "block"
EPILOGUE = "epilogue"


@dataclass(frozen=True)
class ParamInfo:
    """One stored parameter. `name` is its canonical (first) name; `aliases` are tied names."""

    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: str
    aliases: tuple[str, ...] = ()
    no_decay: bool = False  # norms, biases and embeddings: the usual no-weight-decay group


@dataclass(frozen=True)
class LayerCosts:
    """Per-micro-batch compute and activation costs of one layer, for the traced workload."""

    flops_fwd: float = 0.0
    flops_bwd: float = 0.0  # gradient of inputs and parameters, excluding recompute
    # the part of flops_fwd / flops_bwd that is scaled-dot-product attention (its own rate on a GPU)
    attention_flops_fwd: float = 0.0
    attention_flops_bwd: float = 0.0
    boundary_activation_bytes: int = 0  # the layer's output (the next layer's input)
    saved_activation_bytes: int = 0  # what autograd saves for backward when activations are kept
    peak_workspace_bytes: int = 0  # transient memory of one forward+backward beyond the above


@dataclass(frozen=True)
class Layer:
    id: int
    kind: str  # PROLOGUE | BLOCK | EPILOGUE
    name: str  # module path of a block ("model.layers.3"), or "prologue" / "epilogue"
    params: tuple[ParamInfo, ...]
    tied_param_names: tuple[str, ...] = ()  # stored by another layer, used here too
    module_class: str = ""
    costs: LayerCosts = field(default_factory=LayerCosts)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def vocab_param(self, vocab_size: int) -> ParamInfo | None:
        """The [vocab, hidden] table (embedding or head) this prologue / epilogue stores, tied to the
        head or not; None for blocks and where there is none."""
        if self.kind == BLOCK:
            return None
        return next((p for p in self.params if len(p.shape) == 2 and p.shape[0] == vocab_size and vocab_size > 1),
                    None)


@dataclass(frozen=True)
class LayerGraph:
    """The whole model as layers, for one workload (micro-batch shape and dtype)."""

    model_class: str
    blocks_path: str  # attribute path of the ModuleList of blocks ("model.layers")
    layers: tuple[Layer, ...]
    vocab_size: int
    hidden_size: int
    batch_size: int
    seq_len: int
    compute_dtype: str
    trace_method: str  # "export" | "module"
    block_output: str  # "tensor" | "tuple": what a block's forward returns
    forward_kwargs: tuple[str, ...] = ()  # keyword arguments the model's forward accepts
    # ops of the model's own forward found by torch.export ("prologue:aten.mul.Tensor(tok)"); () if
    # trace_method == "module"
    forward_ops: tuple[str, ...] = ()
    # how blocks' saved_activation_bytes were counted: "eager" (autograd's saved tensors) or
    # "aot-min-cut" (what a torch.compile'd block keeps: ir/compiled_saved.py)
    saved_bytes_method: str = "eager"
    # the model's logits are a bias-free nn.Linear head's plain output (get_output_embeddings; no scaling,
    # soft-capping or copy after it): the loss may be fused, chunk by chunk, and the head stream by
    # vocabulary chunk; otherwise the model's own forward makes the whole logits
    linear_head: bool = True

    @property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind == BLOCK)

    @property
    def prologue(self) -> Layer:
        return self.layers[0]

    @property
    def epilogue(self) -> Layer:
        return self.layers[-1]

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    @property
    def tied_table(self) -> ParamInfo | None:
        """The prologue's vocabulary table when the epilogue's head is tied to it and may stream with it:
        the only parameter of another layer the epilogue names, named by no block."""
        table = self.prologue.vocab_param(self.vocab_size)
        if table is None or self.epilogue.tied_param_names != (table.name,) \
                or self.epilogue.vocab_param(self.vocab_size) is not None \
                or any(table.name in b.tied_param_names for b in self.blocks):
            return None
        return table

    def vocab_table(self, layer_id: int) -> ParamInfo | None:
        """The vocabulary table the prologue / epilogue would stream by row chunks: one it stores and no
        other layer uses (untied), or the tied table (stored by the prologue, `tied_table`). None
        otherwise (blocks, no table, a table used some other way)."""
        layer = self.layers[layer_id]
        if layer.id not in (self.prologue.id, self.epilogue.id):
            return None
        if self.tied_table is not None:
            return self.tied_table
        table = layer.vocab_param(self.vocab_size)
        return table if table is not None and not table.aliases and not layer.tied_param_names else None

    def streamable(self, layer_id: int) -> bool:
        """Whether the prologue's / epilogue's vocabulary table may stream by row chunks (vocab_table;
        the head only as a plain linear head, and a tied table only for both layers: vocab_sets)."""
        if self.vocab_table(layer_id) is None:
            return False
        return self.linear_head or (self.layers[layer_id].kind != EPILOGUE and self.tied_table is None)

    def vocab_sets(self) -> list[frozenset]:
        """Every set of the prologue / epilogue whose tables may stream together, resident first: a tied
        table streams for both layers (its two uses) or for neither."""
        ids = [i for i in (self.prologue.id, self.epilogue.id) if self.streamable(i)]
        if self.tied_table is not None:
            return [frozenset()] + ([frozenset(ids)] if ids else [])
        return [frozenset()] + [frozenset({i}) for i in ids] + ([frozenset(ids)] if len(ids) == 2 else [])

    def edge_resident_numel(self, vocab_streamed) -> int:
        """Parameters of the prologue and epilogue held on the device for the whole step: all but the
        tables of the layers in `vocab_streamed` (a tied table once, stored by the prologue)."""
        held = 0
        for layer in (self.prologue, self.epilogue):
            table = layer.vocab_param(self.vocab_size) if layer.id in vocab_streamed else None
            held += layer.numel - (table.numel if table is not None else 0)
        return held

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """SHA-256 of the IR's structure (layers, parameters, shapes, dtypes, workload): identifies
        what a plan was made for. Costs, traced ops and how they were counted are left out: another torch or transformers
        version may trace the same model to other ops and byte counts, and a plan made there still
        fits this model (compile checks the lowered program's memory against the budget here)."""
        data = self.to_dict()
        for key in ("forward_ops", "trace_method", "saved_bytes_method", "linear_head"):
            data.pop(key)
        for layer in data["layers"]:
            layer.pop("costs")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def dag(self) -> nx.DiGraph:
        """Dependencies over integer node ids: forward chain, backward chain, updates, tied edges.

        Nodes are `(op, layer_id)` with op in {"fwd", "bwd", "update"}.
        """
        g = nx.DiGraph()
        n = len(self.layers)
        for i in range(n):
            for op in ("fwd", "bwd", "update"):
                g.add_node((op, i))
            if i + 1 < n:
                g.add_edge(("fwd", i), ("fwd", i + 1), kind="forward")
                g.add_edge(("bwd", i + 1), ("bwd", i), kind="backward")
            g.add_edge(("bwd", i), ("update", i), kind="gradient")
        g.add_edge(("fwd", n - 1), ("bwd", n - 1), kind="loss")
        owner = {p.name: layer.id for layer in self.layers for p in layer.params}
        for layer in self.layers:
            for name in layer.tied_param_names:
                g.add_edge(("bwd", layer.id), ("update", owner[name]), kind="tied")
        return g
