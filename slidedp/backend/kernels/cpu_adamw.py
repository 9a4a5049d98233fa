"""Numba CPU AdamW on flat fp32 host state, with bf16 gradients in and bf16 weights out.

`adamw_step` updates fp32 master weights and AdamW moments in place (or, with `to=`, into other
arrays, leaving its inputs as they were: early updates, backend/runtime/early_updates.py) with the float32 math
of the single-tensor `torch.optim.AdamW` (decoupled weight decay, bias correction), and can
write the updated weights rounded to bfloat16 in the same pass (round-to-nearest-even,
bit-exact with `torch.Tensor.to(torch.bfloat16)`; any NaN becomes 0xFFFF as there).
Results match torch to 1 ulp: the moments bit for bit on AVX2 builds, the weights up to
torch's CPU sqrt (MKL), which is itself up to 1 ulp off the correctly rounded one used here.
bfloat16 values travel as `uint16` arrays of bit patterns (numpy has no bfloat16; from
torch: `t.view(torch.uint16).numpy()`).

Any contiguous 1-D slice can be updated on its own, so a layer can be updated chunk by
chunk. The kernels release the GIL: several Python threads may update different chunks at
once, each on its own Numba thread team, whose size is thread-local (`num_threads=` per
call, or the module default from `set_num_threads`). Blocks are scheduled dynamically, so
a thread slowed by other work on its core does not hold back the rest.

`adamw_step(..., impl=)` picks the implementation: "numba" (the kernels here), "torch" (torch's
fused CPU AdamW with the same inputs and outputs, cpu_adamw_torch.py), or "auto" (the default):
torch where the measured table `TORCH_FASTER` says it is faster for that case, else numba.

Threading layer: `omp` or `tbb` (`threadsafe` is requested unless NUMBA_THREADING_LAYER
says otherwise); `workqueue` is refused because it aborts when two threads call in.
"""

from __future__ import annotations

import sys
import threading

import numba
import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload
from llvmlite import ir as llvm_ir

__all__ = [
    "IMPLS",
    "TORCH_FASTER",
    "adamw_step",
    "choose_impl",
    "threads_bucket",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "set_num_threads",
    "get_num_threads",
    "threading_layer",
]

# ---------------------------------------------------------------------------------------
# Threading layer: must be chosen before Numba launches its thread pool.

if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"  # tbb if importable, else omp

_layer_lock = threading.Lock()
_layer_checked = False
_default_num_threads: int | None = None


def _ensure_thread_safe_layer() -> None:
    """Launch Numba's thread pool (once) and refuse a layer that is not thread safe."""
    global _layer_checked
    if _layer_checked:
        return
    with _layer_lock:
        if _layer_checked:
            return
        requested = numba.config.THREADING_LAYER
        # Launching Numba's OpenMP pool resets the caller's OpenMP max-threads, which torch
        # (sharing the same libgomp) reads as its intra-op thread count: keep torch's.
        torch = sys.modules.get("torch")
        torch_threads = torch.get_num_threads() if torch is not None else None
        numba.get_num_threads()  # launches the pool with the configured layer
        if torch is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        layer = numba.threading_layer()
        if layer not in ("omp", "tbb"):
            raise RuntimeError(
                f"slidedp.backend.kernels.cpu_adamw needs Numba's 'omp' or 'tbb' threading layer, got "
                f"{layer!r} (requested {requested!r}); 'workqueue' aborts when called from two "
                "threads. Unset NUMBA_THREADING_LAYER (or set it to 'omp'/'tbb'), install a "
                "working OpenMP runtime or `pip install tbb`, and make sure no other code "
                "launched Numba's thread pool earlier."
            )
        _layer_checked = True


def threading_layer() -> str:
    """Return the Numba threading layer in use ('omp' or 'tbb'), launching it if needed."""
    _ensure_thread_safe_layer()
    return numba.threading_layer()


def set_num_threads(n: int | None) -> None:
    """Set the default team size of every later call, from any Python thread.

    `None` restores Numba's default (`numba.config.NUMBA_NUM_THREADS`). A per-call
    `num_threads=` overrides it. Thread-safe: the value is applied to the calling
    thread's (thread-local) Numba setting at each call.
    """
    global _default_num_threads
    if n is not None:
        _check_num_threads(n)
    _default_num_threads = None if n is None else int(n)


def get_num_threads() -> int:
    """Team size a call from this thread would use now."""
    _ensure_thread_safe_layer()
    if _default_num_threads is not None:
        return _default_num_threads
    return numba.config.NUMBA_NUM_THREADS


def _check_num_threads(n) -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"num_threads must be an int, got {type(n).__name__}")
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(
            f"num_threads must be between 1 and NUMBA_NUM_THREADS="
            f"{numba.config.NUMBA_NUM_THREADS}, got {n}"
        )


def _launch(kernel, *args) -> None:
    """Run a parallel kernel with dynamic scheduling of `_CHUNK_BLOCKS` blocks at a time.

    Numba's chunk size is thread-local, set here rather than in the kernel (a kernel that
    sets it cannot be cached) and restored afterwards.
    """
    old = numba.set_parallel_chunksize(_CHUNK_BLOCKS)
    try:
        kernel(*args)
    finally:
        numba.set_parallel_chunksize(old)


def _apply_num_threads(num_threads: int | None) -> None:
    """Set the calling thread's Numba team size (Numba keeps it thread-local)."""
    _ensure_thread_safe_layer()
    n = _default_num_threads if num_threads is None else num_threads
    if n is None:
        n = numba.config.NUMBA_NUM_THREADS
    elif num_threads is not None:
        _check_num_threads(n)
    if numba.get_num_threads() != n:
        numba.set_num_threads(int(n))


# ---------------------------------------------------------------------------------------
# Kernel constants and scalar helpers (inlined into the kernels).

_BLOCK_ELEMS = 1 << 13  # elements per prange block (~230 KB of state touched per block)
# Blocks a thread takes at a time (dynamic scheduling), so that a thread slowed by other work on its
# core (H2D copies, other ranks) does not hold back the whole update.
_CHUNK_BLOCKS = 4
_U32_SIGN_MASK = np.uint32(0x7FFFFFFF)
_U32_INF_BITS = np.uint32(0x7F800000)
_U32_ROUND_BIAS = np.uint32(0x7FFF)
_U32_ONE = np.uint32(1)
_U16_NAN = np.uint16(0xFFFF)  # what torch's vectorised float->bf16 writes for any NaN

# No fastmath flags: the loops vectorise without them (8 floats per AVX2 op), 'contract'
# would fuse other multiply-adds than torch does, and 'nnan'/'ninf'/'afn'/'arcp' would break
# NaN handling or IEEE sqrt/div. The multiply-adds that torch's AVX2/AVX-512 kernels fuse
# (lerp, addcmul) are fused explicitly, so m and v match torch bit for bit there.
_JIT = dict(nogil=True, cache=True, error_model="numpy", fastmath=False)


@intrinsic
def _fmuladd_f32(typingctx, a, b, c):
    """a*b + c as LLVM's fmuladd: one rounding (FMA) on FMA hardware, as torch's kernels."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = llvm_ir.FloatType()
        fnty = llvm_ir.FunctionType(f32, [f32, f32, f32])
        fn = builder.module.declare_intrinsic("llvm.fmuladd", [f32], fnty)
        return builder.call(fn, args)

    return sig, codegen


@njit(inline="always", **_JIT)
def _bf16_to_f32(h):
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@njit(inline="always", **_JIT)
def _f32_to_bf16(x):
    """Round-to-nearest-even on the bit pattern; NaN -> 0xFFFF as torch's vector path."""
    u = np.float32(x).view(np.uint32)
    if (u & _U32_SIGN_MASK) > _U32_INF_BITS:
        return _U16_NAN
    r = (u + ((u >> np.uint32(16)) & _U32_ONE) + _U32_ROUND_BIAS) >> np.uint32(16)
    return np.uint16(r)


def _load_grad(g, i):
    """g[i] as float32 (bf16 bit patterns widened); the overload below is what Numba compiles."""
    return np.uint32(g[i]).__lshift__(16).view(np.float32) if g.dtype == np.uint16 else np.float32(g[i])


@overload(_load_grad, inline="always", jit_options=_JIT)
def _load_grad_ov(g, i):
    if isinstance(g, types.Array) and g.dtype == types.uint16:
        return lambda g, i: _bf16_to_f32(g[i])
    if isinstance(g, types.Array) and g.dtype == types.float32:
        return lambda g, i: g[i]
    return None


@njit(inline="always", **_JIT)
def _adamw_elem(p, g, m, v, grad_scale, decay, lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps,
                neg_step):
    """One element of torch's single-tensor AdamW, float32 throughout."""
    g = g * grad_scale
    p = p * decay
    # torch's lerp(m, g, w): fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g).
    m = _fmuladd_f32(lerp_w, g - m, g if lerp_from_g else m)
    v = _fmuladd_f32(w2 * g, g, v * beta2)  # torch's v.mul_(beta2).addcmul_(g, g, w2)
    denom = np.sqrt(v) / bc2_sqrt + eps
    p = p + neg_step * m / denom
    return p, m, v


# ---------------------------------------------------------------------------------------
# Kernels.


# Each prange iteration updates one block through slices indexed from 0: a provably
# non-negative index (no wraparound select) is what lets LLVM vectorise the inner loop.


@njit(parallel=True, **_JIT)
def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, grad_scale, decay, lerp_w, lerp_from_g,
                  beta2, w2, bc2_sqrt, eps, neg_step):
    n = param.size
    n_blocks = (n + _BLOCK_ELEMS - 1) // _BLOCK_ELEMS
    for b in prange(n_blocks):
        lo = b * _BLOCK_ELEMS
        hi = min(lo + _BLOCK_ELEMS, n)
        p_b, g_b, m_b, v_b = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        for i in range(hi - lo):
            p, m, v = _adamw_elem(p_b[i], _load_grad(g_b, i), m_b[i], v_b[i],
                                  grad_scale, decay, lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps,
                                  neg_step)
            p_b[i] = p
            m_b[i] = m
            v_b[i] = v


@njit(parallel=True, **_JIT)
def _adamw_bf16out_kernel(param, grad, exp_avg, exp_avg_sq, out_bf16, grad_scale, decay,
                          lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps, neg_step):
    n = param.size
    n_blocks = (n + _BLOCK_ELEMS - 1) // _BLOCK_ELEMS
    for b in prange(n_blocks):
        lo = b * _BLOCK_ELEMS
        hi = min(lo + _BLOCK_ELEMS, n)
        p_b, g_b, m_b, v_b = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        o_b = out_bf16[lo:hi]
        for i in range(hi - lo):
            p, m, v = _adamw_elem(p_b[i], _load_grad(g_b, i), m_b[i], v_b[i],
                                  grad_scale, decay, lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps,
                                  neg_step)
            p_b[i] = p
            m_b[i] = m
            v_b[i] = v
            o_b[i] = _f32_to_bf16(p)


@njit(parallel=True, **_JIT)
def _adamw_to_kernel(param, grad, exp_avg, exp_avg_sq, param_to, exp_avg_to, exp_avg_sq_to, out_bf16,
                     grad_scale, decay, lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps, neg_step):
    """Out of place: reads param / exp_avg / exp_avg_sq, writes the updated values to the `_to`
    arrays (and, unless out_bf16 is None, the bf16 weights): the inputs stay as they were."""
    n = param.size
    n_blocks = (n + _BLOCK_ELEMS - 1) // _BLOCK_ELEMS
    for b in prange(n_blocks):
        lo = b * _BLOCK_ELEMS
        hi = min(lo + _BLOCK_ELEMS, n)
        p_b, g_b, m_b, v_b = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        pt_b, mt_b, vt_b = param_to[lo:hi], exp_avg_to[lo:hi], exp_avg_sq_to[lo:hi]
        for i in range(hi - lo):
            p, m, v = _adamw_elem(p_b[i], _load_grad(g_b, i), m_b[i], v_b[i],
                                  grad_scale, decay, lerp_w, lerp_from_g, beta2, w2, bc2_sqrt, eps,
                                  neg_step)
            pt_b[i] = p
            mt_b[i] = m
            vt_b[i] = v
        if out_bf16 is not None:
            o_b = out_bf16[lo:hi]
            for i in range(hi - lo):
                o_b[i] = _f32_to_bf16(pt_b[i])


@njit(parallel=True, **_JIT)
def _bf16_to_f32_kernel(src_u16, dst_f32):
    n = src_u16.size
    n_blocks = (n + _BLOCK_ELEMS - 1) // _BLOCK_ELEMS
    for b in prange(n_blocks):
        lo = b * _BLOCK_ELEMS
        hi = min(lo + _BLOCK_ELEMS, n)
        s_b, d_b = src_u16[lo:hi], dst_f32[lo:hi]
        for i in range(hi - lo):
            d_b[i] = _bf16_to_f32(s_b[i])


@njit(parallel=True, **_JIT)
def _f32_to_bf16_kernel(src_f32, dst_u16):
    n = src_f32.size
    n_blocks = (n + _BLOCK_ELEMS - 1) // _BLOCK_ELEMS
    for b in prange(n_blocks):
        lo = b * _BLOCK_ELEMS
        hi = min(lo + _BLOCK_ELEMS, n)
        s_b, d_b = src_f32[lo:hi], dst_u16[lo:hi]
        for i in range(hi - lo):
            d_b[i] = _f32_to_bf16(s_b[i])


# ---------------------------------------------------------------------------------------
# Validation.


def _check_array(name: str, a, dtypes: tuple, writable: bool) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in dtypes:
        allowed = " or ".join(np.dtype(d).name for d in dtypes)
        hint = ""
        if np.dtype(np.uint16) in dtypes and a.dtype == np.int16:
            hint = " (view bfloat16 bits as uint16: arr.view(np.uint16))"
        raise TypeError(f"{name} must have dtype {allowed}, got {a.dtype}{hint}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous (got strides {a.strides})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable")


def _check_same_length(**arrays) -> None:
    sizes = {k: a.size for k, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError("arrays must have equal lengths, got " +
                         ", ".join(f"{k}={n}" for k, n in sizes.items()))


def _check_no_overlap(**arrays) -> None:
    items = list(arrays.items())
    for i, (ka, a) in enumerate(items):
        for kb, b in items[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError(f"{ka} and {kb} must not overlap in memory")


_F32 = (np.dtype(np.float32),)
_U16 = (np.dtype(np.uint16),)
_GRAD = (np.dtype(np.float32), np.dtype(np.uint16))


# ---------------------------------------------------------------------------------------
# Choice of implementation.

IMPLS = ("auto", "numba", "torch")

# Cases where torch's fused CPU AdamW (cpu_adamw_torch.py) was measured faster than the Numba kernel,
# keyed (threads_bucket(num_threads), writes_bf16_copy, grad_dtype "fp32" | "bf16"). Filled from the
# records of benchmarks/cpu_adamw/results (run.py prints the entries its measurement supports) measured
# on the target machine; empty until such a measurement shows torch faster in some case.
TORCH_FASTER: frozenset[tuple[str, bool, str]] = frozenset()


def threads_bucket(num_threads: int) -> str:
    """The TORCH_FASTER key of a team size: "1", "2-4" or "5+" (the study's 1, 4 and all threads)."""
    if num_threads <= 1:
        return "1"
    return "2-4" if num_threads <= 4 else "5+"


def choose_impl(impl: str, *, num_threads: int, bf16_copy: bool, grad_dtype: str, out_of_place: bool) -> str:
    """"numba" or "torch" for a call: `impl` itself unless "auto"; then torch only where TORCH_FASTER
    lists the case (never out of place: torch would first copy the state into `to`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if out_of_place:
        return "numba"
    return "torch" if (threads_bucket(num_threads), bf16_copy, grad_dtype) in TORCH_FASTER else "numba"


def _resolved_num_threads(num_threads: int | None) -> int:
    if num_threads is not None:
        return int(num_threads)
    return get_num_threads()


# ---------------------------------------------------------------------------------------
# Public API.


def adamw_step(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray,
               out_bf16: np.ndarray | None = None, *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
               num_threads: int | None = None, to: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               impl: str = "auto") -> None:
    """One AdamW update of a contiguous 1-D chunk, as `torch.optim.AdamW`: in place, or into `to`.

    param, exp_avg, exp_avg_sq: float32, updated in place.
    grad: float32, or uint16 holding bfloat16 bit patterns.
    out_bf16: optional uint16 array that receives the updated param as bfloat16 bits
        (round-to-nearest-even, bit-exact with torch; any NaN becomes 0xFFFF like torch).
    grad_scale: multiplies the gradient first (gradient clipping, loss-scale removal).
    step: 1-based step count of this update (bias correction).
    num_threads: Numba team size for this call (default: `set_num_threads` value, else all).
    to: (param, exp_avg, exp_avg_sq) float32 arrays that receive the updated values, leaving the
        inputs unchanged (an update that can still be taken back); None: in place.
    impl: "numba" (this module's kernels), "torch" (torch's fused AdamW, cpu_adamw_torch.py) or
        "auto": torch where TORCH_FASTER lists the case, else numba (`choose_impl`).

    Math, in float32: p *= 1 - lr*wd; m = lerp(m, g, 1-beta1); v = beta2*v + (1-beta2)*g*g;
    p -= (lr / (1 - beta1**step)) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps).
    Releases the GIL; safe to call from several threads on non-overlapping chunks.
    """
    _check_array("param", param, _F32, True)
    _check_array("grad", grad, _GRAD, False)
    _check_array("exp_avg", exp_avg, _F32, True)
    _check_array("exp_avg_sq", exp_avg_sq, _F32, True)
    if out_bf16 is not None:
        _check_array("out_bf16", out_bf16, _U16, True)
        _check_same_length(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                           out_bf16=out_bf16)
        _check_no_overlap(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                          out_bf16=out_bf16)
    else:
        _check_same_length(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        _check_no_overlap(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if to is not None:
        if len(to) != 3:
            raise ValueError(f"to must be (param, exp_avg, exp_avg_sq), got {len(to)} arrays")
        for name, a in zip(("param_to", "exp_avg_to", "exp_avg_sq_to"), to):
            _check_array(name, a, _F32, True)
        _check_same_length(param=param, param_to=to[0], exp_avg_to=to[1], exp_avg_sq_to=to[2])
        _check_no_overlap(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param_to=to[0],
                          exp_avg_to=to[1], exp_avg_sq_to=to[2],
                          **({} if out_bf16 is None else {"out_bf16": out_bf16}))
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based), got {step}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas must be in [0, 1), got beta1={beta1}, beta2={beta2}")
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
                         f"weight_decay={weight_decay}")
    if num_threads is not None:
        _check_num_threads(num_threads)
    if impl == "numba" or (impl == "auto" and not TORCH_FASTER):
        chosen = "numba"
    else:
        chosen = choose_impl(impl, num_threads=_resolved_num_threads(num_threads), bf16_copy=out_bf16 is not None,
                             grad_dtype="bf16" if grad.dtype == np.uint16 else "fp32", out_of_place=to is not None)
    if param.size == 0:
        return
    if chosen == "torch":
        from slidedp.backend.kernels.cpu_adamw_torch import adamw_step_torch

        adamw_step_torch(param, grad, exp_avg, exp_avg_sq, out_bf16, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                         num_threads=_resolved_num_threads(num_threads), to=to)
        return

    # Scalars as torch forms them (Python double) then rounds to the float32 op type.
    f32 = np.float32
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    w1 = f32(1.0 - beta1)
    lerp_from_g = bool(w1 >= f32(0.5))
    scalars = (
        f32(grad_scale),
        f32(1.0 - lr * weight_decay),
        f32(w1 - f32(1.0)) if lerp_from_g else w1,
        lerp_from_g,
        f32(beta2),
        f32(1.0 - beta2),
        f32(bias_correction2 ** 0.5),
        f32(eps),
        f32(-(lr / bias_correction1)),
    )
    _apply_num_threads(num_threads)
    if to is not None:
        _launch(_adamw_to_kernel, param, grad, exp_avg, exp_avg_sq, *to, out_bf16, *scalars)
    elif out_bf16 is None:
        _launch(_adamw_kernel, param, grad, exp_avg, exp_avg_sq, *scalars)
    else:
        _launch(_adamw_bf16out_kernel, param, grad, exp_avg, exp_avg_sq, out_bf16, *scalars)


def bf16_bits_to_float32(u16: np.ndarray, out: np.ndarray | None = None, *,
                         num_threads: int | None = None) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16, contiguous 1-D) to float32 exactly."""
    _check_array("u16", u16, _U16, False)
    if out is None:
        out = np.empty(u16.size, dtype=np.float32)
    else:
        _check_array("out", out, _F32, True)
        _check_same_length(u16=u16, out=out)
        _check_no_overlap(u16=u16, out=out)
    if u16.size:
        _apply_num_threads(num_threads)
        _launch(_bf16_to_f32_kernel, u16, out)
    return out


def float32_to_bf16_bits(f32: np.ndarray, out: np.ndarray | None = None, *,
                         num_threads: int | None = None) -> np.ndarray:
    """Round float32 (contiguous 1-D) to bfloat16 bits (uint16), bit-exact with torch.

    Round-to-nearest-even; inf stays inf, subnormals round like normal numbers (no
    flush), any NaN becomes 0xFFFF as in torch's vectorised conversion of a contiguous
    tensor (torch's scalar path writes 0x7FC0; both are quiet NaNs).
    """
    _check_array("f32", f32, _F32, False)
    if out is None:
        out = np.empty(f32.size, dtype=np.uint16)
    else:
        _check_array("out", out, _U16, True)
        _check_same_length(f32=f32, out=out)
        _check_no_overlap(f32=f32, out=out)
    if f32.size:
        _apply_num_threads(num_threads)
        _launch(_f32_to_bf16_kernel, f32, out)
    return out
