"""Where `compile` takes the initial weights from: the model's own parameters, a folder of
safetensors files, or a function that fills each one.

A model larger than half the host's RAM cannot be built with its weights before `compile` copies
them into the host state (16 bytes per parameter): build it with its parameters on the meta device
(`accelerate.init_empty_weights()`, which leaves buffers such as rotary frequencies real; a Hugging
Face model's tied head is tied then, as `from_pretrained` would) and pass `weights=`; each parameter
is then read straight into its fp32 master, one tensor at a time.

  weights=None        the model's parameters (they must not be on the meta device)
  weights="dir"       a Hugging Face checkpoint folder: model.safetensors or its shards (any
                      *.safetensors file in it), or one .safetensors file; a parameter is looked
                      up under its name and, for tied ones, under each alias
  weights=fn          fn(name, out) writes parameter `name`'s value into `out`, an fp32 tensor of
                      the parameter's shape (its master weights in the host state; on the device
                      for a layer whose optimizer state lives there alone)

Tensors of a folder are read a slab of rows at a time (at most costmodel.memory.LOAD_STAGING_BYTES
of fp32), so no parameter is ever whole on the host beyond its master there.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from slidedp.backend.state.staging import copy_in_pieces_
from slidedp.costmodel.memory import LOAD_STAGING_BYTES
from slidedp.errors import UnsupportedModelError
from slidedp.ir.graph import LayerGraph

log = logging.getLogger("slidedp")


def tie_meta_model(model: nn.Module) -> None:
    """Tie a Hugging Face model's head to its embeddings (as its config says) when its parameters are
    on the meta device: `init_empty_weights()` builds it untied, `from_pretrained` would tie it."""
    if hasattr(model, "tie_weights") and any(p.device.type == "meta" for p in model.parameters()):
        model.tie_weights()


def check_weights_source(model: nn.Module, graph: LayerGraph, weights) -> None:
    """Refuse, before anything is allocated, what `fill_masters` could not load: meta buffers, meta
    parameters without `weights`, a folder without safetensors, a parameter it lacks or holds in
    another shape (read from the files' headers)."""
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise UnsupportedModelError(
            f"{len(meta_buffers)} buffers of the model are on the meta device (e.g. {meta_buffers[0]}), and no "
            "checkpoint holds them (they are computed when the model is built): build the model under "
            "accelerate.init_empty_weights(), which puts only the parameters on the meta device")
    if weights is None:
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if meta:
            raise UnsupportedModelError(
                f"compile needs the model's weights, but {len(meta)} parameters are on the meta device "
                f"(e.g. {meta[0]}): pass weights= (a safetensors checkpoint folder or a function that fills "
                "each parameter), or use slidedp.plan() to plan only")
    elif not callable(weights):
        _checkpoint_tensors(graph.layers, weights)


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(path.glob("*.safetensors")) if path.is_dir() else []


def checkpoint_shapes(weights) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{tensor key: (file, shape)} of a safetensors folder or file, from the files' headers; a file
    that cannot be read is a ValueError naming it."""
    files = safetensors_files(weights)
    if not files:
        raise FileNotFoundError(f"weights={str(weights)!r}: no .safetensors file there")
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for key in reader.keys():
                    shapes.setdefault(key, (f, tuple(reader.get_slice(key).get_shape())))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary by version
            raise ValueError(f"weights: cannot read {f} ({type(exc).__name__}: {exc})") from None
    return shapes


def _checkpoint_tensors(layers, weights) -> dict[Path, list[tuple[str, str]]]:
    """{file: [(parameter, key in the file)]} for every stored parameter of `layers`, its shape
    checked against the file's header."""
    shapes = checkpoint_shapes(weights)
    wanted: dict[Path, list[tuple[str, str]]] = {}
    missing = []
    for layer in layers:
        for p in layer.params:
            key = next((k for k in (p.name, *p.aliases) if k in shapes), None)
            if key is None:
                missing.append(p.name)
                continue
            f, shape = shapes[key]
            if shape != tuple(p.shape):
                raise ValueError(f"weights: {key} in {f.name} has shape {shape}, the model's {p.name} {tuple(p.shape)}")
            wanted.setdefault(f, []).append((p.name, key))
    if missing:
        raise ValueError(f"weights={str(weights)!r} has no tensor for {len(missing)} parameters of the model "
                         f"(e.g. {', '.join(missing[:3])})")
    return wanted


def read_rows_into(dst: torch.Tensor, reader, key: str, *, piece_bytes: int = LOAD_STAGING_BYTES) -> None:
    """Tensor `key` of an open safetensors file into `dst` (fp32, its shape, any device), a slab of
    leading-dimension rows at a time (at most `piece_bytes` of fp32, at least one row)."""
    sl = reader.get_slice(key)
    shape = tuple(sl.get_shape())
    if len(shape) == 0 or dst.numel() == 0:
        dst.copy_(reader.get_tensor(key))
        return
    row_numel = max(1, dst.numel() // max(1, shape[0]))
    rows = max(1, piece_bytes // (4 * row_numel))
    flat = dst.view(shape[0], -1)
    for r in range(0, shape[0], rows):
        copy_in_pieces_(flat[r : r + rows], sl[r : r + rows], piece_bytes=piece_bytes)


def fill_masters(layers, masters: dict[str, torch.Tensor], weights) -> None:
    """Write every stored parameter of `layers` its initial value into `masters[name]` (fp32 views,
    of the host state or of the device's master) from the checkpoint folder or function `weights`
    (checked by `check_weights_source`)."""
    if callable(weights):
        for layer in layers:
            for p in layer.params:
                weights(p.name, masters[p.name])
        return
    wanted = _checkpoint_tensors(layers, weights)
    for i, (f, items) in enumerate(sorted(wanted.items()), 1):
        log.info("loading weights: %s (%d/%d files, %d tensors)", f.name, i, len(wanted), len(items))
        with safe_open(str(f), framework="pt", device="cpu") as reader:
            for name, key in items:
                read_rows_into(masters[name], reader, key)


def fill_held_masters(model: nn.Module, layers, held: dict, weights) -> None:
    """Write the initial weights of the layers held in part on this host (several hosts) into their
    runs: `held[layer id]` is the layer's `LayerArrays` (backend/state/host_state.py), whose runs
    [lo, hi) of the layer are packed in its master. One parameter at a time: from the model's own
    (weights=None), or whole in a temporary (fp32, one parameter) from `weights`."""
    sources = None if weights is None or callable(weights) else {
        name: (f, key) for f, items in _checkpoint_tensors(layers, weights).items() for name, key in items}
    for layer in layers:
        arrays, start = held[layer.id], 0
        for p in layer.params:
            end = start + p.numel
            parts = [(max(lo, start), min(hi, end), here.start - lo) for lo, hi, here in arrays.held()
                     if lo < end and start < hi]  # (a, b, where element 0 of the layer would sit here)
            if parts:
                if weights is None:
                    value = model.get_parameter(p.name).detach().reshape(-1)
                else:
                    value = torch.empty(p.shape, dtype=torch.float32)
                    if callable(weights):
                        weights(p.name, value)
                    else:
                        f, key = sources[p.name]
                        with safe_open(str(f), framework="pt", device="cpu") as reader:
                            read_rows_into(value, reader, key)
                    value = value.reshape(-1)
                for a, b, shift in parts:
                    arrays.master[shift + a : shift + b].copy_(value[a - start : b - start])
            start = end


def bind_parameters(model: nn.Module, graph: LayerGraph, views: dict[str, torch.Tensor]) -> None:
    """Make each stored parameter (under its name and every alias) a view of the host state. A
    parameter on the meta device, or whose view is (a layer held in part on this host: several
    hosts), is replaced by a new nn.Parameter (the same object for every alias, so ties hold);
    others keep their object and take the view as their data."""
    stored = set()
    for layer in graph.layers:
        for p in layer.params:
            stored.update((p.name, *p.aliases))
            param = model.get_parameter(p.name)
            view = views[p.name]
            if param.device.type != "meta" and view.device.type != "meta":
                param.data = view
                continue
            new = nn.Parameter(view, requires_grad=param.requires_grad)
            for name in (p.name, *p.aliases):
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = new
    left = [n for n, q in model.named_parameters(remove_duplicate=False) if q.device.type == "meta" and n not in stored]
    if left:
        raise UnsupportedModelError(f"{len(left)} parameters the model does not train are on the meta device "
                                    f"(e.g. {left[0]}); weights= loads trained parameters only")
