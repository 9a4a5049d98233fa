"""Build a `LayerGraph` from an nn.Module, without touching real weights.

Everything runs under FakeTensorMode: the model's forward is called with its blocks replaced by
proxies (which records the modules used before and after the blocks, and what each block is
given), then one block of each distinct shape is run forward and backward under FlopCounterMode
and saved-tensor hooks to count its FLOPs and the activation bytes it saves for backward. Works
for models on the meta device (an 8B shape builds in seconds).

Then `torch.export(strict=False)` of the same forward (`export_trace.py`) must agree: every block
once, in order, nothing between blocks; it gives `trace_method="export"` and the ops of the model's
own forward (`forward_ops`). If export fails, the module structure above stands (`"module"`).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from slidedp.errors import UnsupportedModelError
from slidedp.ir.blocks import (
    BlockCall,
    HeadCapture,
    StopForward,
    find_blocks,
    forward_kwargs,
    logits_of,
    proxied_blocks,
    unwrap_block_output,
    wrap_block_output,
)
from slidedp.ir.compiled_saved import compiled_saved_bytes
from slidedp.ir.export_trace import EXTRA_FLOP_FORMULAS, ExportGroups, export_layer_groups_or_reason
from slidedp.ir.graph import BLOCK, EPILOGUE, PROLOGUE, Layer, LayerCosts, LayerGraph, ParamInfo
from slidedp.logs import warn_once

_NO_DECAY_CLASSES = ("Norm", "Embedding")


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab:
        return int(vocab)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise UnsupportedModelError(f"{type(model).__name__} has no nn.Embedding (token embedding)")
    return int(embeddings[0].num_embeddings)


def _fake_state(
    model: nn.Module, dtype: torch.dtype, requires_grad: bool, skip_prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Fake stand-ins for every parameter and buffer not under `skip_prefix` (in FakeTensorMode)."""
    state = {}
    for name, p in model.named_parameters():
        if skip_prefix is None or not name.startswith(skip_prefix):
            dt = dtype if p.is_floating_point() else p.dtype
            state[name] = torch.empty(p.shape, dtype=dt).requires_grad_(requires_grad and p.requires_grad)
    for name, b in model.named_buffers():
        if skip_prefix is None or not name.startswith(skip_prefix):
            state[name] = torch.empty(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
    return state


@contextmanager
def _masks_as_at_runtime():
    """Hugging Face mask helpers treat a FakeTensor as tracing and then build a dense [b, 1, s, s]
    causal mask, where the executor (real tensors, one unpacked sequence per row, no padding mask)
    gets none and SDPA runs causal: quadratic memory that exists only in the trace (64 GiB at
    262,144 tokens). During the trace, report what the runtime finds: no packed sequences."""
    try:  # transformers only for its mask helpers, where this version has them
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


_aten = torch.ops.aten
_SDPA_BACKWARD = {getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
) if hasattr(_aten, name)}


class AttentionWorkspace(TorchDispatchMode):
    """The transient memory of the largest SDPA backward seen: the gradients of query, key and value
    (their dtype) and an fp32 accumulator of the query's gradient, as the GPU's flash backward
    allocates (bytes = q (elem + 4) + (k + v) elem). What a block's saved tensors do not show, and
    what grows to gigabytes at long sequences (4 GiB of accumulator at 262,144 tokens, Qwen3-4B)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _SDPA_BACKWARD:
            q, k, v = args[1], args[2], args[3]
            self.bytes = max(self.bytes, q.numel() * (q.element_size() + 4) + (k.numel() + v.numel()) * k.element_size())
        return out


def attention_flops_counted(counter: FlopCounterMode) -> float:
    """The FLOPs a counter gave scaled-dot-product attention (any backend's kernels, forward or
    backward; each op counted once, at the top level)."""
    ops = counter.get_flop_counts().get("Global", {})
    return float(sum(n for op, n in ops.items() if "scaled_dot_product" in str(op)))


def _no_decay(module: nn.Module, param_name: str) -> bool:
    cls = type(module).__name__
    return param_name.endswith("bias") or any(s in cls for s in _NO_DECAY_CLASSES)


def _trace_block(block: nn.Module, call: BlockCall, dtype: torch.dtype,
                 compiled: bool) -> tuple[LayerCosts, str, str]:
    """FLOPs and saved-activation bytes of one block on fake tensors; also its output kind and how
    the saved bytes were counted.
    Its workspace: the largest saved tensor, two boundary activations and the attention backward's.
    `compiled`: the saved bytes are what the block's compiled graph keeps (compiled_saved.py)."""
    params = _fake_state(block, dtype, requires_grad=True)
    hidden = call.hidden.detach().requires_grad_(True)
    args, kwargs = call.with_hidden(hidden)
    param_storages = {id(t.untyped_storage()) for t in params.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        sid = id(t.untyped_storage())
        if sid not in param_storages:
            saved[sid] = max(saved.get(sid, 0), t.untyped_storage().nbytes())
        return t

    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fwd_counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(block, params, args, kwargs)
    out_hidden, kind = unwrap_block_output(out)
    grads_of = [hidden] + [p for p in params.values() if p.requires_grad]
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as bwd_counter, \
            AttentionWorkspace() as attention:
        torch.autograd.grad(out_hidden, grads_of, torch.ones_like(out_hidden), allow_unused=True)
    boundary = out_hidden.numel() * out_hidden.element_size()
    saved_bytes, method = int(sum(saved.values())), "eager"
    compiled_bytes = _cached_compiled_saved_bytes(block, params, args, kwargs, dtype) if compiled else None
    if compiled_bytes is not None:
        saved_bytes, method = compiled_bytes, "aot-min-cut"
    costs = LayerCosts(
        flops_fwd=float(fwd_counter.get_total_flops()),
        flops_bwd=float(bwd_counter.get_total_flops()),
        attention_flops_fwd=attention_flops_counted(fwd_counter),
        attention_flops_bwd=attention_flops_counted(bwd_counter),
        boundary_activation_bytes=boundary,
        saved_activation_bytes=saved_bytes,
        peak_workspace_bytes=int(max(saved.values(), default=0)) + 2 * boundary + attention.bytes,
    )
    return costs, kind, method


_COMPILED_SAVED: dict[tuple, int | None] = {}


def _cached_compiled_saved_bytes(block, params, args, kwargs, dtype) -> int | None:
    """compiled_saved_bytes, once per block structure and call shape (a trace takes seconds)."""
    leaves, spec = tree_flatten((args, kwargs))
    key = (_block_signature(block), str(dtype), str(spec), tuple(
        (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t) for t in leaves))
    if key not in _COMPILED_SAVED:
        _COMPILED_SAVED[key] = compiled_saved_bytes(block, params, args, kwargs)
    return _COMPILED_SAVED[key]


def build_layer_graph(
    model: nn.Module,
    *,
    batch_size: int,
    seq_len: int,
    compute_dtype: torch.dtype = torch.bfloat16,
    compiled_blocks: bool = False,
) -> LayerGraph:
    """Trace `model` for micro-batches of `batch_size` x `seq_len` tokens into a LayerGraph.
    `compiled_blocks`: count a kept block's activations as its torch.compile graph saves them
    (`saved_bytes_method` "aot-min-cut") rather than as eager autograd does ("eager")."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    blocks_path, blocks = find_blocks(model)
    n_blocks = len(blocks)
    vocab = _vocab_size(model)
    allowed = forward_kwargs(model)

    # 1. The model's forward with proxied blocks: which modules run before/after the blocks.
    module_names = {id(m): n for n, m in model.named_modules()}
    block_module_ids = {id(m) for m in blocks.modules()}
    phase = {"now": PROLOGUE}
    first_phase: dict[str, str] = OrderedDict()
    calls: list[BlockCall] = []

    def pre_hook(module, _args):
        if id(module) in block_module_ids:
            return
        name = module_names.get(id(module))
        if name is not None and name not in first_phase:
            first_phase[name] = phase["now"]

    def handler(index: int, call: BlockCall):
        if index != len(calls):
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward called block {index} after {len(calls)} blocks; "
                "slidedp needs every block called once, in order"
            )
        calls.append(call)
        if index == n_blocks - 1:
            phase["now"] = EPILOGUE
        return wrap_block_output(call.hidden, block_kind["kind"])

    block_kind = {"kind": "tensor"}
    with FakeTensorMode(allow_non_fake_inputs=True), _masks_as_at_runtime():
        fake = _fake_state(model, compute_dtype, requires_grad=False, skip_prefix=blocks_path + ".")
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        # The block's output kind is needed by the proxies: trace block 0 on its own first.
        with proxied_blocks(model, blocks_path, _capture_first(calls_first := [])):
            try:
                torch.func.functional_call(model, fake, (ids,), _kw(allowed))
            except StopForward:
                pass
            except Exception as exc:  # noqa: BLE001 - report what the model needs
                raise UnsupportedModelError(
                    f"tracing {type(model).__name__}.forward with proxied blocks failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        if not calls_first:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward never called its blocks ({blocks_path})"
            )
        block_costs: dict[tuple, tuple[LayerCosts, str]] = {}
        for i, block in enumerate(blocks):
            key = _block_signature(block)
            if key not in block_costs:
                call = calls_first[0]
                try:
                    block_costs[key] = _trace_block(block, call, compute_dtype, compiled_blocks)
                except UnsupportedModelError:
                    raise
                except Exception as exc:  # noqa: BLE001 - report which block and why
                    experts = any(name.endswith("experts") for name, _ in block.named_modules())
                    raise UnsupportedModelError(
                        f"tracing block {blocks_path}.{i} ({type(block).__name__}) forward and backward on fake "
                        f"tensors failed: {type(exc).__name__}: {str(exc)[:500]}" + (
                            " (a mixture-of-experts block: torch's fake grouped matmul takes bf16 only; plan it "
                            "with precision='bf16')" if experts and "BF16" in str(exc) else "")
                    ) from exc
        block_kind["kind"] = block_costs[_block_signature(blocks[0])][1]

        handles = [m.register_forward_pre_hook(pre_hook) for m in model.modules()]
        try:
            with proxied_blocks(model, blocks_path, handler):
                out = torch.func.functional_call(model, fake, (ids,), _kw(allowed))
            logits = logits_of(out)
        finally:
            for h in handles:
                h.remove()
        head = HeadCapture.find(model)
        if head is not None:  # again, blocks passed through, the head captured: are the logits its plain output?
            def passed(index: int, call: BlockCall):
                return wrap_block_output(call.hidden, block_kind["kind"])

            with proxied_blocks(model, blocks_path, passed), head.active() as cap:
                plain_head = cap.returned_as_logits(torch.func.functional_call(model, fake, (ids,), _kw(allowed)))
        if len(calls) != n_blocks:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward called {len(calls)} of its {n_blocks} blocks"
            )
        if logits.shape[-1] != vocab or logits.shape[:2] != (batch_size, seq_len):
            raise UnsupportedModelError(
                f"logits have shape {tuple(logits.shape)}; expected ({batch_size}, {seq_len}, {vocab})"
            )
        hidden_size = int(calls[0].hidden.shape[-1])
        boundary_bytes = calls[0].hidden.numel() * calls[0].hidden.element_size()

    # 2. torch.export's view of the same forward: must agree; if export fails, the above stands.
    groups, why = export_layer_groups_or_reason(
        model, blocks_path, n_blocks, batch_size, seq_len, block_output=block_kind["kind"]
    )
    if groups is None:
        warn_once(("torch.export", type(model).__name__, why),
                  "torch.export of %s failed (%s): the IR falls back to the module structure (trace_method "
                  "'module', no forward_ops)", type(model).__name__, why)
    else:
        _check_export(model, groups, blocks_path, n_blocks)

    # 3. Parameters: by identity, canonical name first; owner = first layer that uses them.
    layers = _assign_params(model, blocks_path, blocks, first_phase)
    tokens = batch_size * seq_len
    out_layers = []
    saved_bytes_method = "eager"
    for layer_id, (kind, name, params, tied, cls, block) in enumerate(layers):
        if kind == BLOCK:
            costs, _, saved_bytes_method = block_costs[_block_signature(block)]
        else:
            matrix_numel = sum(
                p.numel for p in params if len(p.shape) == 2 and not p.no_decay
            ) + sum(_numel_of(model, t) for t in tied)
            logits_bytes = tokens * vocab * 4 if kind == EPILOGUE else 0
            costs = LayerCosts(
                flops_fwd=2.0 * tokens * matrix_numel if kind == EPILOGUE else 0.0,
                flops_bwd=4.0 * tokens * matrix_numel if kind == EPILOGUE else 0.0,
                boundary_activation_bytes=boundary_bytes if kind == PROLOGUE else 0,
                saved_activation_bytes=logits_bytes + (boundary_bytes if kind == EPILOGUE else 0),
                peak_workspace_bytes=2 * logits_bytes,
            )
        out_layers.append(Layer(layer_id, kind, name, params, tied, cls, costs))
    return LayerGraph(
        model_class=type(model).__name__,
        blocks_path=blocks_path,
        layers=tuple(out_layers),
        vocab_size=vocab,
        hidden_size=hidden_size,
        batch_size=batch_size,
        seq_len=seq_len,
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        trace_method="module" if groups is None else "export",
        block_output=block_kind["kind"],
        forward_kwargs=allowed,
        forward_ops=() if groups is None else groups.forward_ops,
        saved_bytes_method=saved_bytes_method,
        linear_head=head is not None and plain_head,
    )


def _check_export(model: nn.Module, groups: ExportGroups, blocks_path: str, n_blocks: int) -> None:
    name = type(model).__name__
    if groups.block_order != tuple(range(n_blocks)):
        raise UnsupportedModelError(
            f"torch.export of {name}.forward runs the blocks of {blocks_path} in the order "
            f"{list(groups.block_order)}, but the module structure has {n_blocks} blocks that must run "
            "once each, in order"
        )
    if groups.between_ops:
        raise UnsupportedModelError(
            f"{name}.forward applies {sorted(set(groups.between_ops))} to the hidden state between blocks "
            f"of {blocks_path}; slidedp chains the blocks directly and needs no ops between them"
        )


def _kw(allowed: tuple[str, ...]) -> dict:
    return {"use_cache": False} if "use_cache" in allowed else {}


def _capture_first(store: list):
    def handler(index: int, call: BlockCall):
        store.append(call)
        raise StopForward
    return handler


def _block_signature(block: nn.Module) -> tuple:
    return (type(block).__name__,) + tuple(
        (n, tuple(p.shape), p.requires_grad) for n, p in block.named_parameters()
    )


def _numel_of(model: nn.Module, name: str) -> int:
    return model.get_parameter(name).numel()


def _assign_params(model, blocks_path, blocks, first_phase):
    """Group trainable parameters into prologue / blocks / epilogue, tied ones stored once."""
    names_by_id: dict[int, list[str]] = OrderedDict()
    module_of: dict[str, nn.Module] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            names_by_id.setdefault(id(p), [])
            if full not in names_by_id[id(p)]:
                names_by_id[id(p)].append(full)
            module_of[full] = module
    params_by_id = {id(p): p for p in model.parameters()}

    prologue, epilogue = [], []
    block_params: list[list[ParamInfo]] = [[] for _ in blocks]
    tied_in_epilogue: list[str] = []
    prefix = blocks_path + "."
    for pid, names in names_by_id.items():
        p = params_by_id[pid]
        if not p.requires_grad:
            continue  # frozen: a constant, no optimizer state
        canonical = names[0]
        info = ParamInfo(
            name=canonical,
            shape=tuple(p.shape),
            numel=p.numel(),
            dtype=str(p.dtype).removeprefix("torch."),
            aliases=tuple(names[1:]),
            no_decay=p.ndim < 2 or _no_decay(module_of[canonical], canonical),
        )
        if canonical.startswith(prefix):
            index = int(canonical[len(prefix):].split(".")[0])
            if any(not n.startswith(prefix) for n in names):
                raise UnsupportedModelError(
                    f"parameter {canonical} of a block is shared outside the blocks ({names})"
                )
            block_params[index].append(info)
            continue
        phases = {first_phase.get(n.rpartition(".")[0], PROLOGUE) for n in names}
        if PROLOGUE in phases:
            prologue.append(info)
            if EPILOGUE in phases:
                tied_in_epilogue.append(canonical)
        else:
            epilogue.append(info)
    out = [(PROLOGUE, "prologue", tuple(prologue), (), type(model).__name__, None)]
    for i, block in enumerate(blocks):
        out.append((BLOCK, f"{blocks_path}.{i}", tuple(block_params[i]), (), type(block).__name__, block))
    out.append((EPILOGUE, "epilogue", tuple(epilogue), tuple(tied_in_epilogue), type(model).__name__, None))
    return out
