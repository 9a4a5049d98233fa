"""Finding a model's ModuleList of blocks and standing in for its blocks during the model's forward.

slidedp runs the model's own forward for the prologue and epilogue (so logic that lives in the
forward — embedding scaling, position ids, masks, rotary tables — is the model's own), with each
block replaced by a `BlockProxy` that hands the call to slidedp. The proxy records what the model
passes to each block, or returns a hidden state slidedp computed elsewhere.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from slidedp.errors import UnsupportedModelError


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList whose children hold the most parameters (ties: the outermost)."""
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel == 0 or any(sum(1 for _ in child.parameters()) == 0 for child in module):
            continue
        key = (numel, -path.count("."))
        if best is None or key > best[:2]:
            best = (numel, -path.count("."), path, module)
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no nn.ModuleList of blocks with parameters: slidedp needs "
            "an embedding, a ModuleList of blocks (any attribute name) and a head"
        )
    return best[2], best[3]


def forward_kwargs(model: nn.Module) -> tuple[str, ...]:
    """The keyword arguments of the model's forward that slidedp may pass."""
    params = inspect.signature(model.forward).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return tuple(k for k in ("attention_mask", "use_cache") if k in params or var_kw)


def get_submodule_parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


class StopForward(Exception):
    """Raised by a proxy to end the model's forward once the needed inputs are captured."""


@dataclass
class BlockCall:
    """What the model passed to one block: positional and keyword arguments."""

    args: tuple
    kwargs: dict

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]

    def with_hidden(self, hidden: torch.Tensor) -> tuple[tuple, dict]:
        if self.args:
            return (hidden, *self.args[1:]), self.kwargs
        return self.args, {**self.kwargs, "hidden_states": hidden}


def wrap_block_output(hidden: torch.Tensor, block_output: str) -> Any:
    return (hidden,) if block_output == "tuple" else hidden


def unwrap_block_output(out: Any) -> tuple[torch.Tensor, str]:
    if isinstance(out, torch.Tensor):
        return out, "tensor"
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], "tuple"
    raise UnsupportedModelError(
        f"a block returned {type(out).__name__}; slidedp needs a tensor or a tuple whose first "
        "element is the hidden state"
    )


class BlockProxy(nn.Module):
    """Stands in for block `index`; `handler(index, BlockCall)` returns what the block returns."""

    def __init__(self, index: int, handler: Callable[[int, BlockCall], Any]):
        super().__init__()
        self.index = index
        self.handler = handler

    def forward(self, *args, **kwargs):
        return self.handler(self.index, BlockCall(args, kwargs))


@contextlib.contextmanager
def proxied_blocks(model: nn.Module, blocks_path: str, handler: Callable[[int, BlockCall], Any]):
    """Temporarily replace the ModuleList at `blocks_path` with proxies calling `handler`."""
    parent, attr = get_submodule_parent(model, blocks_path)
    original = getattr(parent, attr)
    proxies = nn.ModuleList(BlockProxy(i, handler) for i in range(len(original)))
    parent._modules[attr] = proxies
    try:
        yield original
    finally:
        parent._modules[attr] = original


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's forward output: a tensor, an object with `.logits`, or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UnsupportedModelError(
        f"the model's forward returned {type(output).__name__}; slidedp needs logits (a tensor, "
        "an output with .logits, or a tuple starting with logits)"
    )


class HeadCapture:
    """Stands in for the output head (a bias-free nn.Linear) during the model's forward: records its
    input and weight and returns a placeholder of the logits' shape that holds no memory.

    If the model's forward returns that placeholder itself as its logits, the logits are exactly
    `input @ weight.T` (no scaling, soft-capping or slicing after the head) and the loss can be
    computed by a fused linear + cross-entropy from the recorded input; otherwise not.
    """

    def __init__(self, head: nn.Linear):
        self.head = head
        self.input: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.placeholder: torch.Tensor | None = None

    @staticmethod
    def find(model: nn.Module) -> "HeadCapture | None":
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if isinstance(head, nn.Linear) and head.bias is None:
            return HeadCapture(head)
        return None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input, self.weight = x, self.head.weight  # under functional_call: the tensor passed in
        self.placeholder = x.new_zeros(()).expand(*x.shape[:-1], self.head.out_features)
        return self.placeholder

    @contextlib.contextmanager
    def active(self):
        self.input = self.weight = self.placeholder = None
        self.head.forward = self._forward  # an instance attribute shadows the class's forward
        try:
            yield self
        finally:
            del self.head.forward

    def returned_as_logits(self, output: Any) -> bool:
        return self.placeholder is not None and logits_of(output) is self.placeholder
