"""What a block run through `torch.compile` saves for its backward.

Eager autograd saves every tensor an op asks for; Inductor's AOTAutograd splits the joint
forward+backward graph with the min-cut partitioner instead, which saves fewer, recomputing cheap
elementwise results (norms, activations, rotary products) in the backward. Counting the eager
saves for a compiled block overstates its kept activations by about a third on a Qwen3 block, which
the planner would pay for in blocks recomputed instead of kept.

`compiled_saved_bytes` traces the block's functional call with `aot_function` on the fake tensors
the IR builder already uses, partitions it as Inductor does (`min_cut_rematerialization_partition`,
compiler="inductor"), and adds up the distinct storages the forward graph hands to the backward,
leaving out the parameters (the weight slot holds them anyway). No kernel is compiled or run.
Inductor also runs its joint-graph pattern passes before partitioning; they are not applied here,
so the count is the partitioner's, close to but not exactly what a given torch version saves:
equal on a Llama block (Inductor, CPU), up to a fifth high where Inductor regenerates dropout masks
from a seed (GPT-2), and 16 bytes low per attention call on CUDA, whose SDPA kernels also save an
RNG seed and offset (tests/ir/test_compiled_saved.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from slidedp.logs import warn_once


def compiled_saved_bytes(block: nn.Module, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> int | None:
    """Bytes of activations the compiled block's forward saves for its backward (per call), or None
    where AOTAutograd cannot trace it (the caller then keeps the eager count)."""
    try:
        return partition_block(block, params, args, kwargs).saved_bytes
    except Exception as exc:  # noqa: BLE001 - an estimate; the eager count stands in
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        warn_once(("aot-autograd", type(block).__name__, why),
                  "AOTAutograd could not trace %s (%s); the plan counts its eager saved tensors instead, "
                  "likely more than the compiled block keeps", type(block).__name__, why)
        return None


@dataclass
class Partition:
    """A block's joint graph split by the min-cut partitioner: what its forward saves for the backward
    (bytes, the parameters left out) and both graphs (their placeholders carry fake values)."""

    saved_bytes: int
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None


def partition_block(block: nn.Module, params: dict[str, torch.Tensor], args: tuple, kwargs: dict,
                    memory_budget: float = 1.0, backward: bool = False) -> Partition:
    """The block's functional call traced by `aot_function` on its (fake) inputs and split as Inductor
    splits it; `memory_budget` < 1 is AOTAutograd's `activation_memory_budget`: the partitioner saves
    about that share of what it would, recomputing more in the backward. `backward`: also run the
    backward once, so that its graph is there (else it may be None). Raises where it cannot trace."""
    # AOTAutograd's partitioner brings in Inductor and sympy (~3 s, ~900 modules): only for compiled blocks
    import torch._functorch.config as functorch_config
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_function

    names = list(params)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    n_params = len(names)
    seen: dict[str, object] = {}

    def block_fn(*inputs):
        weights, tensors = inputs[:n_params], inputs[n_params:]
        flat = list(leaves)
        for i, t in zip(tensor_at, tensors):
            flat[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(flat, spec)
        out = torch.func.functional_call(block, dict(zip(names, weights)), call_args, call_kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def forward_compiler(gm: torch.fx.GraphModule, _example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        weight_storages = {_storage_key(n) for n in placeholders[:n_params]}
        output = next(n for n in gm.graph.nodes if n.op == "output")
        saved = output.args[0][1:]  # the block's output first, then what the backward receives
        per_storage: dict[object, int] = {}
        for node in saved:
            key = _storage_key(node)
            if key is None or key in weight_storages:
                continue
            per_storage[key] = max(per_storage.get(key, 0), _storage_bytes(node))
        seen["bytes"], seen["forward"] = sum(per_storage.values()), gm
        return make_boxed_func(gm)  # AOTAutograd calls it with a list of arguments

    def backward_compiler(gm: torch.fx.GraphModule, _example_inputs):
        seen["backward"] = gm
        return make_boxed_func(gm)

    with functorch_config.patch(activation_memory_budget=memory_budget):
        traced = aot_function(block_fn, fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                              partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
        inputs = [*params.values(), *(leaves[i] for i in tensor_at)]
        out = traced(*inputs)
        if backward and "backward" not in seen:  # compiled lazily, at the first backward
            torch.autograd.grad(out, [t for t in inputs if t.requires_grad], torch.ones_like(out), allow_unused=True)
    return Partition(seen["bytes"], seen["forward"], seen.get("backward"))


def _storage_key(node: torch.fx.Node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return id(val.untyped_storage())


def _storage_bytes(node: torch.fx.Node) -> int:
    return int(node.meta["val"].untyped_storage().nbytes())
