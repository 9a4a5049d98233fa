"""Moving a device array to or from the host in bounded pieces, through one staging buffer.

The state of the lean layers (host_state.py) lives on the device alone; its initial weights come up,
and checkpoints take it down and put it back, `piece_bytes` (costmodel.memory.LOAD_STAGING_BYTES,
64 MiB: the host bytes the planner and the preflight count for it) at a time, never the whole array on
the host. A CPU "device" array needs no staging: its pieces are views of it.

    for lo, hi, piece in pieces_from(src):    # piece: CPU values of src.view(-1)[lo:hi]
        f.write(...piece...)
    for lo, hi, piece in pieces_into(dst):    # fill piece (CPU); it is copied into dst.view(-1)[lo:hi]
        f.readinto(...piece...)
"""

from __future__ import annotations

from typing import Iterator

import torch

from slidedp.costmodel.memory import LOAD_STAGING_BYTES


def _staged(t: torch.Tensor, staged: bool | None) -> bool:
    return t.device.type != "cpu" if staged is None else staged


def _buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer of `numel` elements (pinned when the device is a GPU: DMA both ways)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def piece_numel(t: torch.Tensor, piece_bytes: int = LOAD_STAGING_BYTES) -> int:
    """Elements of `t` per piece: at most `piece_bytes`, at least one."""
    return max(1, piece_bytes // t.element_size())


def pieces_from(src: torch.Tensor, *, piece_bytes: int = LOAD_STAGING_BYTES,
                staged: bool | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(lo, hi, CPU values of the flat `src`[lo:hi]) for consecutive pieces of a contiguous tensor;
    each piece is valid until the next one is asked for (they share the staging buffer). `staged`
    None: through the buffer unless `src` is on the CPU (then views of it)."""
    flat = src.detach().reshape(-1)
    n, step = flat.numel(), piece_numel(flat, piece_bytes)
    if not _staged(flat, staged):
        for lo in range(0, n, step):
            yield lo, min(lo + step, n), flat[lo : lo + step]
        return
    buf = _buffer(min(step, n), flat.dtype, flat.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        piece = buf[: hi - lo]
        piece.copy_(flat[lo:hi])  # synchronous: the piece is there when it is yielded
        yield lo, hi, piece


def pieces_into(dst: torch.Tensor, *, piece_bytes: int = LOAD_STAGING_BYTES,
                staged: bool | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(lo, hi, a CPU piece to fill) for consecutive pieces of the contiguous `dst`: once the caller
    asks for the next piece (or ends the loop), what it wrote goes into the flat `dst`[lo:hi]. A
    loop left by an exception copies nothing more."""
    flat = dst.detach().view(-1)
    n, step = flat.numel(), piece_numel(flat, piece_bytes)
    if not _staged(flat, staged):
        for lo in range(0, n, step):
            yield lo, min(lo + step, n), flat[lo : lo + step]
        return
    buf = _buffer(min(step, n), flat.dtype, flat.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        piece = buf[: hi - lo]
        yield lo, hi, piece
        flat[lo:hi].copy_(piece)  # synchronous: the buffer may be refilled next


def copy_in_pieces_(dst: torch.Tensor, src: torch.Tensor, *, piece_bytes: int = LOAD_STAGING_BYTES,
                    staged: bool | None = None) -> None:
    """`dst` <- `src` (same number of elements, any dtypes and devices; dst contiguous), a piece at a time:
    host to device through the staging buffer, the cast done on the host."""
    src_flat = src.detach().reshape(-1)
    if src_flat.numel() != dst.numel():
        raise ValueError(f"cannot copy {src_flat.numel()} elements into {dst.numel()}")
    staged = _staged(dst, staged) and src_flat.device.type == "cpu"
    for lo, hi, piece in pieces_into(dst, piece_bytes=piece_bytes, staged=staged):
        piece.copy_(src_flat[lo:hi])


def to_host(src: torch.Tensor, dtype: torch.dtype | None = None, *, piece_bytes: int = LOAD_STAGING_BYTES) -> torch.Tensor:
    """A new CPU tensor of `src`'s values (in `dtype`, default src's), read a piece at a time (a cast
    happens on the device, a piece at a time, so the device never holds a whole cast copy)."""
    dtype = dtype or src.dtype
    out = torch.empty(src.shape, dtype=dtype)
    flat, out_flat = src.detach().reshape(-1), out.view(-1)
    step = piece_numel(flat, piece_bytes)
    for lo in range(0, flat.numel(), step):
        out_flat[lo : lo + step].copy_(flat[lo : lo + step].to(dtype))
    return out
