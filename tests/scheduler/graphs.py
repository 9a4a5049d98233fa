"""Small synthetic layer graphs for the scheduler tests, built directly from the IR dataclasses."""

from __future__ import annotations

from slidedp.ir.graph import BLOCK, EPILOGUE, PROLOGUE, Layer, LayerCosts, LayerGraph, ParamInfo

MiB = 2**20


def synthetic_graph(n_blocks: int = 3, *, block_numel: int = 16 * MiB, flops_fwd: float = 2e12,
                    saved_bytes: int = 512 * MiB, boundary_bytes: int = 32 * MiB, workspace_bytes: int = 64 * MiB,
                    vocab: int = 32000, hidden: int = 2048, tokens: int = 4096, dtype: str = "bfloat16",
                    block_scale: tuple[float, ...] = (), tied: bool = False) -> LayerGraph:
    """Prologue (embedding), `n_blocks` blocks, epilogue (head); costs per micro-batch of `tokens`.

    `block_scale` scales each block's parameters and FLOPs (blocks of different sizes); `tied`: the
    head is the embedding table (stored by the prologue), the epilogue stores a final norm."""
    embed = ParamInfo("embed.weight", (vocab, hidden), vocab * hidden, dtype, aliases=("head.weight",) if tied else ())
    layers = [Layer(0, PROLOGUE, "prologue", (embed,), costs=LayerCosts(boundary_activation_bytes=boundary_bytes))]
    for i in range(n_blocks):
        s = block_scale[i] if i < len(block_scale) else 1.0
        numel = int(block_numel * s)
        layers.append(Layer(
            i + 1, BLOCK, f"blocks.{i}", (ParamInfo(f"blocks.{i}.weight", (numel,), numel, dtype),),
            costs=LayerCosts(flops_fwd=flops_fwd * s, flops_bwd=2 * flops_fwd * s,
                             boundary_activation_bytes=boundary_bytes, saved_activation_bytes=int(saved_bytes * s),
                             peak_workspace_bytes=workspace_bytes)))
    head = vocab * hidden
    costs = LayerCosts(flops_fwd=2.0 * tokens * head, flops_bwd=4.0 * tokens * head)
    if tied:
        layers.append(Layer(n_blocks + 1, EPILOGUE, "epilogue", (ParamInfo("norm.weight", (hidden,), hidden, dtype),),
                            tied_param_names=("embed.weight",), costs=costs))
    else:
        layers.append(Layer(n_blocks + 1, EPILOGUE, "epilogue",
                            (ParamInfo("head.weight", (vocab, hidden), head, dtype),), costs=costs))
    return LayerGraph(model_class="Synthetic", blocks_path="blocks", layers=tuple(layers), vocab_size=vocab,
                      hidden_size=hidden, batch_size=1, seq_len=tokens, compute_dtype=dtype, trace_method="module",
                      block_output="tensor")
