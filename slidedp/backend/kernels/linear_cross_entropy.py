"""Fused linear + cross-entropy: the loss and its gradients without the full [T, V] logits.

Inputs: hidden [T, H] and weight [V, H] of one dtype (bf16 on GPU, fp32 in tests), labels [T]
int64, already shifted by the caller (`next_token_labels`), -100 = ignored. With
logits = hidden @ weight.T (fp32 accumulation), valid[t] = labels[t] != -100:

    loss          = scale * sum_t valid[t] * (logsumexp(logits[t]) - logits[t, labels[t]])   (fp32)
    dlogits[t, v] = scale * valid[t] * (softmax(logits[t])[v] - [v == labels[t]])
    grad_hidden   = dlogits @ weight       grad_weight = dlogits.T @ hidden

A sum, not a mean: the caller divides by the global token count (`scale=1/global_tokens` gives
the executor's token-weighted loss and gradients). A head with a bias is not supported
(`bias=` raises ValueError). Labels outside [0, V) other than -100 are not checked (that
would need a host sync): they give a wrong loss instead of an error.

Triton path of `linear_cross_entropy` (loss and both gradients in one call, what the executor
runs), per chunk of C tokens: fp32 logits [C, V] by one cuBLAS GEMM (bf16 operands, fp32
accumulation and output: `addmm(out_dtype=float32)`; where torch lacks it, bf16 logits taken to
fp32, as a bf16 head's autograd would give); `_lce_rows_kernel`, one program per token, reads its
row twice: a streaming max and sum of exponentials (logsumexp) and the target logit, then
dlogits = coef * (softmax - one-hot) in the compute dtype; grad_hidden = dlogits @ weight and
grad_weight += dlogits.T @ hidden (fp32) by cuBLAS. Three dense GEMMs at cuBLAS's rate and two
passes over the chunk's logits; the chunk is the executor's `loss_chunk_tokens`.

Triton path of the autograd Function `LinearCrossEntropy` (forward and backward called apart, so
nothing of the [C, V] chunk may outlive the forward). Forward: `_lce_fwd_kernel`, grid (token
blocks, vocab splits); each program makes [BLOCK_T, BLOCK_V] logit tiles with `tl.dot` over H
(fp32 accumulation), keeps a streaming max and sum of exponentials and picks up the target logit,
and writes (max, sumexp, target) per split, [n_split, T]; torch merges the splits,
lse = M + log(sum_s sumexp_s * exp(max_s - M)). No logits are written at all; the vocabulary is
split so that a few token blocks still fill the GPU. Backward, per chunk of C tokens:
`_lce_bwd_kernel` recomputes the logits tile by tile from the saved lse and writes dlogits [C, V]
in the compute dtype; grad_hidden and grad_weight are two torch matmuls (cuBLAS) on that chunk,
grad_weight summed in fp32.

Reference path (any device, any dtype): the same chunks in torch, logits in fp32 per chunk
([C, V] at a time, never [T, V]); it matches `F.cross_entropy(hidden.float() @
weight.float().T, labels, ignore_index=-100, reduction="sum")` and its autograd gradients.

Cost for T tokens (e = bytes per element of the compute dtype), `linear_cross_entropy`:
  FLOPs: 2*T*V*H (logits) + 2*T*V*H (grad_hidden) + 2*T*V*H (grad_weight) = 6*T*V*H, plus about
         5*T*V exp/add/mul.
  Bytes: per chunk, the logits written in fp32 and read twice (12*C*V), dlogits written and read
         by two GEMMs (3*C*V*e), grad_weight read and written in fp32 (8*V*H), on top of the
         GEMMs' reads of hidden and weight.
  Memory: the logits and dlogits of one chunk, C*V*(4 + e), plus grad_weight V*H*4; C is
          `chunk_tokens`, by default 2**26 // V tokens rounded down to a multiple of BLOCK_T.
  The autograd Function's path computes the logits twice (8*T*V*H) and holds only dlogits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slidedp.backend.kernels._triton import cdiv, kernel, tl, use_triton
from slidedp.logs import warn_once

IGNORE_INDEX = -100
BLOCK_T, BLOCK_V, BLOCK_H = 64, 128, 64  # tl.dot needs every tile side >= 16
NUM_WARPS = 8
ROW_BLOCK_V = 4096  # vocabulary entries per step of _lce_rows_kernel
CHUNK_ELEMENTS = 2**26  # default tokens per backward chunk: CHUNK_ELEMENTS // V
_TARGET_PROGRAMS = 512  # forward programs wanted: enough to fill a large GPU twice


class LinearCrossEntropyResult(NamedTuple):
    loss: torch.Tensor  # 0-dim fp32: scale * sum of token cross-entropies
    grad_hidden: torch.Tensor  # [T, H], hidden's dtype
    grad_weight: torch.Tensor  # [V, H] fp32 (the grad_weight_acc buffer when one is given)


# ---------------------------------------------------------------------------------------------
# public API


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         scale: float | torch.Tensor = 1.0, chunk_tokens: int | None = None,
                         grad_weight_acc: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None) -> LinearCrossEntropyResult:
    """Loss and both gradients in one call, no autograd (see the module docstring).

    `grad_weight_acc`: an fp32 [V, H] buffer the weight gradient is added into (e.g. the head's
    view of the layer accumulator); a fresh zero buffer when None. Triton on CUDA (or under
    TRITON_INTERPRET=1 in fp32 on CPU), the chunked torch reference otherwise.
    """
    _check(hidden, weight, labels, bias)
    grad_weight = _weight_buffer(weight, grad_weight_acc)
    with torch.no_grad():
        valid = labels != IGNORE_INDEX
        coef = valid.float() * scale
        if hidden.shape[0] and use_triton(hidden, weight, labels):
            lse, tgt, grad_hidden = _fused_triton(hidden, weight, labels, coef,
                                                  _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_tokens),
                                                  grad_weight)
        else:
            lse, tgt = _forward(hidden, weight, labels, chunk_tokens)
            grad_hidden = _backward(hidden, weight, labels, lse, coef, chunk_tokens, grad_weight)
        loss = torch.where(valid, lse - tgt, 0.0).sum() * scale
    return LinearCrossEntropyResult(loss, grad_hidden, grad_weight)


class LinearCrossEntropy(torch.autograd.Function):
    """`LinearCrossEntropy.apply(hidden, weight, labels, scale=1.0, chunk_tokens=None)`.

    Returns scale * (sum of token cross-entropies), fp32; backward gives scaled gradients for
    hidden and weight (weight's cast to its dtype by autograd). Saves hidden, weight, labels
    and lse [T] fp32; the backward recomputes the logits chunk by chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale=1.0, chunk_tokens=None):
        _check(hidden, weight, labels, None)
        lse, tgt = _forward(hidden, weight, labels, chunk_tokens)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.scale, ctx.chunk_tokens = scale, chunk_tokens
        return torch.where(labels != IGNORE_INDEX, lse - tgt, 0.0).sum() * scale

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        coef = (labels != IGNORE_INDEX).float() * (grad_loss.float() * ctx.scale)
        grad_weight = _weight_buffer(weight, None) if ctx.needs_input_grad[1] else None
        grad_hidden = _backward(hidden, weight, labels, lse, coef, ctx.chunk_tokens, grad_weight)
        return (grad_hidden if ctx.needs_input_grad[0] else None), grad_weight, None, None, None


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels shifted for next-token loss, -100 in the last column, as [B * S].

    Pairs with the unshifted hidden states `hidden.reshape(-1, H)`: position s is scored on
    labels[:, s + 1], so the hidden states need no slicing copy.
    """
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


# ---------------------------------------------------------------------------------------------
# forward and backward: dispatch between Triton and the reference


def _forward(hidden, weight, labels, chunk_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (lse, target logit), fp32 [T] each; chunk_tokens only bounds the reference."""
    if hidden.shape[0] == 0:
        z = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        return z, z
    if use_triton(hidden, weight, labels):
        return _forward_triton(hidden, weight, labels)
    return _forward_reference(hidden, weight, labels, _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_tokens))


def _backward(hidden, weight, labels, lse, coef, chunk_tokens, grad_weight) -> torch.Tensor:
    """grad_hidden; grad_weight (fp32, or None to skip it) accumulated in place."""
    grad_hidden = torch.empty_like(hidden)
    if hidden.shape[0] == 0:
        return grad_hidden
    chunk = _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_tokens)
    if use_triton(hidden, weight, labels, lse, coef):
        _backward_triton(hidden, weight, labels, lse, coef, chunk, grad_hidden, grad_weight)
    else:
        _backward_reference(hidden, weight, labels, lse, coef, chunk, grad_hidden, grad_weight)
    return grad_hidden


# ---------------------------------------------------------------------------------------------
# reference


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   scale: float | torch.Tensor = 1.0,
                                   chunk_tokens: int | None = None) -> LinearCrossEntropyResult:
    """The chunked PyTorch reference of `linear_cross_entropy`, whatever the device."""
    _check(hidden, weight, labels, None)
    grad_weight = _weight_buffer(weight, None)
    with torch.no_grad():
        if hidden.shape[0] == 0:
            return LinearCrossEntropyResult(torch.zeros((), device=hidden.device), torch.empty_like(hidden),
                                            grad_weight)
        chunk = _chunk_tokens(hidden.shape[0], weight.shape[0], chunk_tokens)
        lse, tgt = _forward_reference(hidden, weight, labels, chunk)
        valid = labels != IGNORE_INDEX
        loss = torch.where(valid, lse - tgt, 0.0).sum() * scale
        grad_hidden = torch.empty_like(hidden)
        _backward_reference(hidden, weight, labels, lse, valid.float() * scale, chunk, grad_hidden, grad_weight)
    return LinearCrossEntropyResult(loss, grad_hidden, grad_weight)


def _forward_reference(hidden, weight, labels, chunk):
    T = hidden.shape[0]
    w = weight.float()
    lse = torch.empty(T, dtype=torch.float32, device=hidden.device)
    tgt = torch.empty(T, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        logits = hidden[t0:t1].float() @ w.T
        lse[t0:t1] = torch.logsumexp(logits, dim=1)
        tgt[t0:t1] = logits.gather(1, labels[t0:t1].clamp(min=0)[:, None])[:, 0]
    return lse, tgt


def _backward_reference(hidden, weight, labels, lse, coef, chunk, grad_hidden, grad_weight):
    T = hidden.shape[0]
    w = weight.float()
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        h = hidden[t0:t1].float()
        d = torch.exp(h @ w.T - lse[t0:t1, None])
        valid = labels[t0:t1] != IGNORE_INDEX
        d.scatter_add_(1, labels[t0:t1].clamp(min=0)[:, None], -valid.float()[:, None])
        d *= coef[t0:t1, None]
        grad_hidden[t0:t1] = d @ w
        if grad_weight is not None:
            grad_weight.addmm_(d.T, h)


# ---------------------------------------------------------------------------------------------
# kernels


@kernel
def _lce_fwd_kernel(h_ptr, w_ptr, labels_ptr, max_ptr, sum_ptr, tgt_ptr, T, V, H, stride_h, stride_w,
                    cols_per_split, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    label = tl.load(labels_ptr + rows, mask=rmask, other=-100)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    tgt = tl.zeros([BLOCK_T], dtype=tl.float32)
    v_lo = pid_s * cols_per_split
    v_hi = tl.minimum(v_lo + cols_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < v_hi
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            kmask = ks < H
            h = tl.load(h_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        logits = tl.where(cmask[None, :], acc, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        m = m_new
        tgt += tl.sum(tl.where(cols[None, :] == label[:, None], acc, 0.0), axis=1)
    out = pid_s * T + rows
    tl.store(max_ptr + out, m, mask=rmask)
    tl.store(sum_ptr + out, s, mask=rmask)
    tl.store(tgt_ptr + out, tgt, mask=rmask)


@kernel
def _lce_bwd_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, coef_ptr, dl_ptr, n_tokens, V, H, stride_h, stride_w,
                    stride_dl, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_tokens
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        kmask = ks < H
        h = tl.load(h_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=rmask, other=0.0)
    label = tl.load(labels_ptr + rows, mask=rmask, other=-100)
    p = tl.exp(acc - lse[:, None])
    d = (p - tl.where(cols[None, :] == label[:, None], 1.0, 0.0)) * coef[:, None]
    dl = dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :]
    tl.store(dl, d.to(dl_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@kernel
def _lce_rows_kernel(logits_ptr, labels_ptr, coef_ptr, lse_ptr, tgt_ptr, dl_ptr, V, stride_l, stride_dl,
                     BLOCK_V: tl.constexpr):
    """One token's row of fp32 logits: its logsumexp and target logit, and dlogits in dl's dtype."""
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row)
    coef = tl.load(coef_ptr + row)
    src = logits_ptr + row.to(tl.int64) * stride_l
    m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)  # per lane: running max, sum of exp
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(src + cols, mask=cols < V, other=float("-inf"))
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane that has only seen padding keeps s = 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    tl.store(lse_ptr + row, lse)
    tl.store(tgt_ptr + row, tl.load(src + tl.maximum(label, 0)))
    dst = dl_ptr + row.to(tl.int64) * stride_dl
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(src + cols, mask=cols < V, other=0.0)
        d = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * coef
        tl.store(dst + cols, d.to(dl_ptr.dtype.element_ty), mask=cols < V)


# ---------------------------------------------------------------------------------------------
# launchers


def _fused_triton(hidden, weight, labels, coef, chunk, grad_weight):
    """Loss and both gradients per chunk of C tokens: fp32 logits by cuBLAS, then
    `_lce_rows_kernel` (logsumexp, target, dlogits), then grad_hidden and grad_weight by cuBLAS.
    Returns (lse, target logit, grad_hidden)."""
    hidden, weight, labels = _dense(hidden), _dense(weight), labels.contiguous()
    coef = coef.contiguous()
    T, V = hidden.shape[0], weight.shape[0]
    C = min(chunk, T)
    logits = torch.empty(C, V, dtype=torch.float32, device=hidden.device)
    dlogits = torch.empty(C, V, dtype=hidden.dtype, device=hidden.device)
    lse = torch.empty(T, dtype=torch.float32, device=hidden.device)
    tgt = torch.empty_like(lse)
    grad_hidden = torch.empty_like(hidden)
    block_v = min(ROW_BLOCK_V, triton_next_pow2(V))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        lg, d = logits[: t1 - t0], dlogits[: t1 - t0]
        _matmul_fp32_(lg, hidden[t0:t1], weight.T, accumulate=False)
        _lce_rows_kernel[(t1 - t0,)](lg, labels[t0:], coef[t0:], lse[t0:], tgt[t0:], d, V, lg.stride(0),
                                     d.stride(0), BLOCK_V=block_v, num_warps=NUM_WARPS)
        torch.mm(d, weight, out=grad_hidden[t0:t1])
        if grad_weight is not None:
            _matmul_fp32_(grad_weight, d.T, hidden[t0:t1], accumulate=True)
    return lse, tgt, grad_hidden


def _forward_triton(hidden, weight, labels):
    hidden, weight, labels = _dense(hidden), _dense(weight), labels.contiguous()
    (T, H), V = hidden.shape, weight.shape[0]
    n_tblocks, n_vtiles = cdiv(T, BLOCK_T), cdiv(V, BLOCK_V)
    # Split the vocabulary until the grid is large, keeping >= 2 tiles per split (streaming).
    n_split = max(1, min(cdiv(_TARGET_PROGRAMS, n_tblocks), cdiv(n_vtiles, 2)))
    tiles_per_split = cdiv(n_vtiles, n_split)
    n_split = cdiv(n_vtiles, tiles_per_split)  # no empty split
    parts = torch.empty(3, n_split, T, dtype=torch.float32, device=hidden.device)
    _lce_fwd_kernel[(n_tblocks, n_split)](
        hidden, weight, labels, parts[0], parts[1], parts[2], T, V, H, hidden.stride(0), weight.stride(0),
        tiles_per_split * BLOCK_V, BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
        DOT_PRECISION=_dot_precision(hidden), num_warps=NUM_WARPS)
    m, s, tgt = parts
    top = m.amax(dim=0)
    lse = top + torch.log((s * torch.exp(m - top)).sum(dim=0))
    return lse, tgt.sum(dim=0)


def _backward_triton(hidden, weight, labels, lse, coef, chunk, grad_hidden, grad_weight):
    hidden, weight, labels = _dense(hidden), _dense(weight), labels.contiguous()
    lse, coef = lse.contiguous(), coef.contiguous()
    (T, H), V = hidden.shape, weight.shape[0]
    dlogits = torch.empty(min(chunk, T), V, dtype=hidden.dtype, device=hidden.device)
    precision = _dot_precision(hidden)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        d = dlogits[: t1 - t0]
        _lce_bwd_kernel[(cdiv(t1 - t0, BLOCK_T), cdiv(V, BLOCK_V))](
            hidden[t0:], weight, labels[t0:], lse[t0:], coef[t0:], d, t1 - t0, V, H,
            hidden.stride(0), weight.stride(0), d.stride(0),
            BLOCK_T=BLOCK_T, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, DOT_PRECISION=precision, num_warps=NUM_WARPS)
        torch.mm(d, weight, out=grad_hidden[t0:t1])
        if grad_weight is not None:
            _matmul_fp32_(grad_weight, d.T, hidden[t0:t1], accumulate=True)


# ---------------------------------------------------------------------------------------------
# helpers

_FP32_OUT_MATMUL: dict[str, bool] = {}  # device type -> whether torch.addmm(out_dtype=float32) runs


def _matmul_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """out (+)= a @ b, out fp32: products of bf16 operands summed straight into fp32 when torch can
    (`addmm(..., out_dtype=torch.float32)`, torch >= 2.8 on CUDA); else a @ b is rounded to a's
    dtype first (as a bf16 head's autograd would), then added or copied."""
    if a.dtype == torch.float32:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    kind = out.device.type
    if _FP32_OUT_MATMUL.get(kind, True):
        try:
            torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=torch.float32, out=out)
            _FP32_OUT_MATMUL[kind] = True
            return
        except (RuntimeError, TypeError) as exc:  # no such kernel for this device (a RuntimeError), or an older torch
            _FP32_OUT_MATMUL[kind] = False
            if kind == "cuda":  # expected on the CPU, where torch has no such kernel
                warn_once(("fp32-out-matmul", kind), "fused head + loss: torch.addmm(out_dtype=float32) failed "
                          "on %s (%s: %s); bf16 products are rounded to bf16 before they are summed into the "
                          "fp32 weight gradient", kind, type(exc).__name__, str(exc).strip().split("\n")[0])
    if accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _dot_precision(hidden: torch.Tensor) -> str:
    return "ieee" if hidden.dtype == torch.float32 else "tf32"  # tf32 = the default, unused for bf16


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _chunk_tokens(T: int, V: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is None:
        chunk_tokens = max(BLOCK_T, CHUNK_ELEMENTS // max(V, 1) // BLOCK_T * BLOCK_T)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return min(chunk_tokens, max(T, 1))


def _weight_buffer(weight: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    if acc is None:
        return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if acc.shape != weight.shape or acc.dtype != torch.float32 or acc.device != weight.device:
        raise ValueError(f"grad_weight_acc must be fp32 {tuple(weight.shape)} on {weight.device}, "
                         f"got {acc.dtype} {tuple(acc.shape)} on {acc.device}")
    return acc


def _check(hidden, weight, labels, bias) -> None:
    if bias is not None:
        raise ValueError("linear_cross_entropy: a head with a bias is not supported")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(f"expected int64 labels [{hidden.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden and weight must share a float dtype, got {hidden.dtype} and {weight.dtype}")
    if not hidden.device == weight.device == labels.device:
        raise ValueError(f"hidden, weight and labels on {hidden.device}, {weight.device}, {labels.device}")


# ---------------------------------------------------------------------------------------------
# one vocabulary chunk at a time (backend/runtime/vocab_stream.py: the head streams by row chunk)


def vocab_chunk_forward(hidden: torch.Tensor, weight_chunk: torch.Tensor, local_labels: torch.Tensor,
                        chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logsumexp, target logit) over one chunk of the vocabulary, fp32 [T] each.

    `local_labels`: indices into the chunk, -100 where the label lies outside it (its target logit
    is then 0). The caller folds chunks with logaddexp and sums the target logits."""
    _check(hidden, weight_chunk, local_labels, None)
    with torch.no_grad():
        lse, tgt = _forward(hidden, weight_chunk, local_labels, chunk_tokens)
        return lse, torch.where(local_labels != IGNORE_INDEX, tgt, 0.0)


def vocab_chunk_backward(hidden: torch.Tensor, weight_chunk: torch.Tensor, local_labels: torch.Tensor,
                         lse: torch.Tensor, coef: torch.Tensor, chunk_tokens: int | None,
                         grad_hidden_acc: torch.Tensor, grad_weight_chunk: torch.Tensor) -> None:
    """One chunk's part of the backward, given the whole vocabulary's logsumexp `lse` and the
    per-token coefficient `coef` (scale where the original label is valid, else 0):
    dlogits = coef * (exp(logits - lse) - one-hot(local label)); grad_hidden_acc (fp32 [T, H]) +=
    dlogits @ weight_chunk, grad_weight_chunk (fp32 [rows, H]) += dlogits.T @ hidden. The hidden
    gradient of one chunk is made in hidden's dtype (the kernels' output), then summed in fp32."""
    _check(hidden, weight_chunk, local_labels, None)
    with torch.no_grad():
        grad_hidden_acc += _backward(hidden, weight_chunk, local_labels, lse, coef, chunk_tokens,
                                     grad_weight_chunk).float()
