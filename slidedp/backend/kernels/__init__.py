"""Triton kernels of the GPU gradient path, each beside its PyTorch reference.

The only package where Triton is imported, and only if it is installed: every public
function runs its kernel on CUDA tensors (or on fp32 CPU tensors under TRITON_INTERPRET=1,
Triton's interpreter) and its PyTorch reference otherwise (`_triton.use_triton`). One file
per kernel; import from the files (this package re-exports nothing, so that
`linear_cross_entropy` the module is not hidden by `linear_cross_entropy` the function):
  - `linear_cross_entropy`: fused head + cross-entropy, loss and gradients without the
    [T, V] logits (`linear_cross_entropy`, `LinearCrossEntropy`, `next_token_labels`);
  - `grad_pack`: gradients into the flat layer buffer (write, accumulate, scale, cast to
    bf16) with per-chunk sum of squares and non-finite flags (`pack_grads`, `cast_pack`);
    `accumulate_` and `scale_` are the same kernel with fixed options.
"""
