"""Command-line options that the harnesses share, with the same meaning in each."""

from __future__ import annotations

import argparse

from benchmarks.common.model import MAX_GRAD_NORM, SHAPES
from benchmarks.common.records import add_allow_dirty


def grad_norm(value: str) -> float | None:
    """--max-grad-norm: a float, or "none" (the norm is taken and recorded, nothing is clipped)."""
    return None if value.lower() == "none" else float(value)


def shape_hardware_arg(text: str) -> tuple[str, str]:
    """SHAPE=PROFILE: the hardware of a benchmark shape's points (`slidedp calibrate --model ...`)."""
    shape, _, hardware = text.partition("=")
    if shape not in SHAPES or not hardware:
        raise argparse.ArgumentTypeError(f"{text!r}: want SHAPE=PROFILE, SHAPE one of {', '.join(SHAPES)}")
    return shape, hardware


def checkpoint_choice(value: str) -> str:
    """--baseline-checkpoint: auto, all, none or a non-negative number of leading blocks."""
    if value in ("auto", "all", "none") or (value.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, all, none or a number of blocks, got {value!r}")


def add_model_args(p: argparse.ArgumentParser, several_micro_rows: bool = False) -> None:
    """The model, its training and the timing: identical in every harness. `several_micro_rows`: the
    harness runs each baseline at every --baseline-micro-rows given (a list), each a point of its own."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's, 4096)")
    p.add_argument("--steps", type=int, default=12,
                   help="timed steps after one warm-up step (default 12: the first and the last aside, 10 steady "
                        "steps; fewer than 10 marks the point)")
    p.add_argument("--no-warmup", action="store_true",
                   help="time from the first step (no warm-up step; for runs whose one step is long)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-grad-norm", type=grad_norm, default=MAX_GRAD_NORM,
                   help="global gradient-norm clipping (default 1.0); 'none': no clipping")
    p.add_argument("--nonfinite", choices=["skip", "stop"], default="skip",
                   help="slidedp without clipping: a step with a non-finite gradient is skipped (default), or the "
                        "run stops on it, which lets the plan stream every gradient into its update")
    p.add_argument("--precision", choices=["bf16", "fp32"], help="slidedp (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--baseline-micro-rows", type=int, **({"nargs": "+", "default": [1]} if several_micro_rows else
                                                         {"default": 1}),
                   help="the baselines: rows (sequences) per micro-batch" +
                        (" (several: each baseline runs at each, a point apiece)" if several_micro_rows else ""))
    p.add_argument("--baseline-checkpoint", type=checkpoint_choice, default="auto",
                   help="GPU-resident: blocks with activation checkpointing: 'auto' (the fewest leading blocks "
                        "that fit, probed; default), 'all', 'none' or a number of leading blocks")
    p.add_argument("--baseline-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU-resident: torch.compile each decoder block (default: on CUDA, off on the CPU)")


def add_record_args(p: argparse.ArgumentParser, readme_path: str) -> None:
    """Where records go, the README section they render to, and the clean-tree rule."""
    p.add_argument("--merge", action="store_true", help="keep the records in --out, replacing the points run now")
    p.add_argument("--readme", action="store_true", help="(re)write the marked section of the study's README.md")
    p.add_argument("--readme-path", default=readme_path)
    add_allow_dirty(p)

