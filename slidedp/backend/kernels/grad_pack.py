"""Gradient packing into a layer's flat buffer, with per-chunk sum of squares and non-finite flags.

One operation, `pack_grads`, covers the whole GPU gradient path of a layer:

    out[start : start + numel] = (out[start : start + numel] if accumulate else 0)
                                 + scale * grads[i].reshape(-1)          for (start, numel) = spans[i]

computed in fp32 and stored in `out`'s dtype (fp32, or bf16 rounded to nearest even, as
`Tensor.to(torch.bfloat16)`); a `None` gradient counts as zeros. In the same pass, for each
chunk (lo, hi) of the flat buffer:

    sumsq[c]     = sum of v * v over the values v written in [lo, hi), as stored, summed in fp32
    nonfinite[c] = any v in [lo, hi) is inf or nan

Elements of a chunk that no span covers are not read and count nowhere; written elements
outside every chunk count nowhere. Spans must not overlap; chunks must not overlap.
Both statistics stay on the device (no host sync); `sumsq.sum()` is the layer's squared
norm for exact global clipping, `nonfinite.any()` the overflow check.

The other operations of the path are this one with fixed options (same kernel):
  - `cast_pack(acc, out_bf16, chunks)`: an fp32 accumulator to its bf16 copy for the D2H
    copy, with sumsq/flags of the bf16 values (the ones the host optimizer will see);
  - `accumulate_(dst, src, scale)`: dst_fp32 += scale * src (across micro-batches);
  - `scale_(t, s)`: t *= s in place (scaling for the reduction, e.g. 1/W).
Across micro-batches a caller packs the first with `accumulate=False` (no zero fill needed),
the rest with `accumulate=True`, and asks for chunks only on the last pass it makes.

Kernel: the spans are cut at chunk boundaries into pieces; each piece is one launch of
`_pack_kernel` over cdiv(len, BLOCK) programs (a piece has one source tensor and at most one
chunk, so every argument is a scalar and no device-side table is needed). Each program writes
one fp32 partial sum of squares and one int32 flag into a [n_chunks, max_slots] buffer (no
atomics), which torch reduces over its rows, so results are deterministic. Launches per call:
about n_spans + n_chunks, i.e. host overhead of a few microseconds each.

Cost per element: bytes moved = src (2 or 4) + out read if accumulate (4) + out write (2 or 4);
the partials add 8 bytes per BLOCK elements. FLOPs = 2 (scale, add) + 2 (square, sum) +
2 compares for the flag: memory-bound everywhere.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple, Sequence

import torch

from slidedp.backend.kernels._triton import cdiv, kernel, tl, use_triton

BLOCK = 1024  # elements per program
NUM_WARPS = 4
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PackStats(NamedTuple):
    """Per-chunk statistics of the written values, as device tensors."""

    sumsq: torch.Tensor  # [n_chunks] fp32
    nonfinite: torch.Tensor  # [n_chunks] bool


class _Piece(NamedTuple):
    span: int  # index into spans / grads
    lo: int  # flat element range [lo, hi) in out
    hi: int
    chunk: int  # index into chunks, -1 outside every chunk
    slot: int  # first partial slot of this piece (chunk * max_slots + running count)


class _Plan(NamedTuple):
    pieces: tuple[_Piece, ...]
    n_chunks: int
    max_slots: int  # partial slots per chunk


# ---------------------------------------------------------------------------------------------
# public API


def pack_grads(grads: Sequence[torch.Tensor | None], spans: Sequence[tuple[int, int]], out: torch.Tensor,
               chunks: Sequence[tuple[int, int]] = (), *, scale: float = 1.0,
               accumulate: bool = False) -> PackStats:
    """Write (or add) `scale * grads[i]` into `out` at `spans[i] = (start, numel)`; see the module.

    `out` is a contiguous 1-D fp32, bf16 or fp16 buffer; `accumulate=True` needs fp32. Gradients
    may have any shape and float dtype; they are read in row-major order (a non-contiguous one is
    copied first). Returns per-chunk
    (sumsq, nonfinite) of the values written, in the order of `chunks`.
    """
    srcs = _check(grads, spans, out, accumulate)
    plan = _plan(tuple((int(s), int(n)) for s, n in spans), tuple((int(lo), int(hi)) for lo, hi in chunks),
                 out.numel(), BLOCK)
    present = [g for g in srcs if g is not None]
    if use_triton(out, *present):
        return _pack_triton(srcs, spans, out, plan, float(scale), accumulate)
    return pack_grads_reference(srcs, spans, out, chunks, scale=scale, accumulate=accumulate)


def cast_pack(src: torch.Tensor, out: torch.Tensor, chunks: Sequence[tuple[int, int]] = (), *,
              scale: float = 1.0) -> PackStats:
    """out = (scale * src) in out's dtype (e.g. an fp32 accumulator to its bf16 copy), with stats."""
    n = src.numel()
    return pack_grads([src], [(0, n)], out, chunks, scale=scale)


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """dst += scale * src in place; dst contiguous fp32, src any float dtype of the same numel."""
    pack_grads([src], [(0, dst.numel())], dst.view(-1), scale=scale, accumulate=True)
    return dst


def scale_(t: torch.Tensor, s: float) -> torch.Tensor:
    """t *= s in place (t contiguous, any float dtype; computed in fp32, rounded to t's dtype)."""
    flat = t.view(-1)
    pack_grads([flat], [(0, flat.numel())], flat, scale=s)
    return t


# ---------------------------------------------------------------------------------------------
# reference


def pack_grads_reference(grads: Sequence[torch.Tensor | None], spans: Sequence[tuple[int, int]],
                         out: torch.Tensor, chunks: Sequence[tuple[int, int]] = (), *, scale: float = 1.0,
                         accumulate: bool = False) -> PackStats:
    """PyTorch reference of `pack_grads` (same semantics, any device and dtype)."""
    srcs = _check(grads, spans, out, accumulate)
    plan = _plan(tuple((int(s), int(n)) for s, n in spans), tuple((int(lo), int(hi)) for lo, hi in chunks),
                 out.numel(), BLOCK)
    for g, (start, numel) in zip(srcs, spans):
        dst = out[start : start + numel]
        if g is None:
            if not accumulate:
                dst.zero_()
            continue
        v = g.float() if scale == 1.0 else g.float() * scale
        if accumulate:
            dst.add_(v)
        else:
            dst.copy_(v)
    sumsq = torch.zeros(plan.n_chunks, dtype=torch.float32, device=out.device)
    bad = torch.zeros(plan.n_chunks, dtype=torch.bool, device=out.device)
    for p in plan.pieces:
        if p.chunk >= 0:
            v = out[p.lo : p.hi].float()
            sumsq[p.chunk] += torch.dot(v, v)
            bad[p.chunk] |= ~torch.isfinite(v).all()
    return PackStats(sumsq, bad)


# ---------------------------------------------------------------------------------------------
# kernel and launcher


@kernel
def _pack_kernel(src_ptr, out_ptr, sumsq_ptr, flag_ptr, src_off, out_off, n, slot, scale,
                 HAS_SRC: tl.constexpr, ACCUMULATE: tl.constexpr, REDUCE: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = tl.zeros([BLOCK], dtype=tl.float32)
    if ACCUMULATE:
        r = tl.load(out_ptr + out_off + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SRC:
        g = tl.load(src_ptr + src_off + offs, mask=mask, other=0.0).to(tl.float32)
        r = r + scale * g
    y = r.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_off + offs, y, mask=mask)
    if REDUCE:
        v = y.to(tl.float32)  # masked lanes are 0: they add nothing and are finite
        tl.store(sumsq_ptr + slot + pid, tl.sum(v * v, axis=0))
        bad = (v != v) | (tl.abs(v) == float("inf"))
        tl.store(flag_ptr + slot + pid, tl.max(bad.to(tl.int32), axis=0))


def _pack_triton(srcs, spans, out: torch.Tensor, plan: _Plan, scale: float, accumulate: bool) -> PackStats:
    n_slots = plan.n_chunks * plan.max_slots
    sumsq_part = torch.zeros(max(n_slots, 1), dtype=torch.float32, device=out.device)
    flag_part = torch.zeros(max(n_slots, 1), dtype=torch.int32, device=out.device)
    for p in plan.pieces:
        g = srcs[p.span]
        n = p.hi - p.lo
        _pack_kernel[(cdiv(n, BLOCK),)](
            out if g is None else g, out, sumsq_part, flag_part,
            p.lo - spans[p.span][0], p.lo, n, max(p.slot, 0), scale,
            HAS_SRC=g is not None, ACCUMULATE=accumulate, REDUCE=p.chunk >= 0, BLOCK=BLOCK,
            num_warps=NUM_WARPS)
    if plan.max_slots == 0:
        return PackStats(torch.zeros(plan.n_chunks, dtype=torch.float32, device=out.device),
                         torch.zeros(plan.n_chunks, dtype=torch.bool, device=out.device))
    sumsq = sumsq_part[:n_slots].view(plan.n_chunks, plan.max_slots).sum(1)
    nonfinite = flag_part[:n_slots].view(plan.n_chunks, plan.max_slots).amax(1) > 0
    return PackStats(sumsq, nonfinite)


# ---------------------------------------------------------------------------------------------
# checks and the piece plan (host side, cached: a layer's spans and chunks do not change)


def _check(grads, spans, out: torch.Tensor, accumulate: bool) -> list[torch.Tensor | None]:
    if len(grads) != len(spans):
        raise ValueError(f"{len(grads)} gradients for {len(spans)} spans")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D buffer, got shape {tuple(out.shape)}")
    if out.dtype not in _OUT_DTYPES:
        raise ValueError(f"out dtype {out.dtype} not in {_OUT_DTYPES}")
    if accumulate and out.dtype != torch.float32:
        raise ValueError(f"accumulate=True needs an fp32 out, got {out.dtype}")
    srcs = []
    for i, (g, (_, numel)) in enumerate(zip(grads, spans)):
        if g is None:
            srcs.append(None)
            continue
        if g.numel() != numel:
            raise ValueError(f"gradient {i} has {g.numel()} elements, its span {numel}")
        if not g.is_floating_point():
            raise ValueError(f"gradient {i} has dtype {g.dtype}, expected a float dtype")
        if g.device != out.device:
            raise ValueError(f"gradient {i} is on {g.device}, out on {out.device}")
        srcs.append(g.contiguous().view(-1))  # the kernel reads a dense run of elements
    return srcs


@functools.lru_cache(maxsize=4096)
def _plan(spans: tuple[tuple[int, int], ...], chunks: tuple[tuple[int, int], ...], numel: int,
          block: int) -> _Plan:
    """Cut each span at chunk boundaries; give each piece its partial slots."""
    for start, n in spans:
        if start < 0 or n < 0 or start + n > numel:
            raise ValueError(f"span ({start}, {n}) outside a buffer of {numel} elements")
    for lo, hi in chunks:
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"chunk ({lo}, {hi}) outside a buffer of {numel} elements")
    _check_disjoint([(s, s + n) for s, n in spans], "spans")
    _check_disjoint(chunks, "chunks")
    live = sorted((lo, hi, c) for c, (lo, hi) in enumerate(chunks) if hi > lo)
    los = [lo for lo, _, _ in live]
    cuts = []  # (span, lo, hi, chunk)
    for i, (start, n) in enumerate(spans):
        pos, end = start, start + n
        while pos < end:
            j = bisect.bisect_right(los, pos) - 1
            if j >= 0 and pos < live[j][1]:
                hi, chunk = min(end, live[j][1]), live[j][2]
            else:
                hi, chunk = (min(end, los[j + 1]) if j + 1 < len(live) else end), -1
            cuts.append((i, pos, hi, chunk))
            pos = hi
    used = [0] * len(chunks)
    for _, lo, hi, chunk in cuts:
        if chunk >= 0:
            used[chunk] += cdiv(hi - lo, block)
    max_slots = max(used, default=0)
    running = [0] * len(chunks)
    pieces = []
    for i, lo, hi, chunk in cuts:
        slot = -1
        if chunk >= 0:
            slot = chunk * max_slots + running[chunk]
            running[chunk] += cdiv(hi - lo, block)
        pieces.append(_Piece(i, lo, hi, chunk, slot))
    return _Plan(tuple(pieces), len(chunks), max_slots)


def _check_disjoint(ranges, what: str) -> None:
    prev_hi, prev = None, None
    for lo, hi in sorted((lo, hi) for lo, hi in ranges if hi > lo):
        if prev_hi is not None and lo < prev_hi:
            raise ValueError(f"{what} overlap: {prev} and {(lo, hi)}")
        prev_hi, prev = hi, (lo, hi)
