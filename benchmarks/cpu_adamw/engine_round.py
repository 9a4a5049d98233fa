"""The engine's round of CPU updates against one AdamW call over as many parameters.

A Qwen3-like model (random weights, tied vocabulary) is trained for --steps steps with clipping at 1.0, so
the CPU updates every host layer at the step boundary (one round a step, backend/runtime/update_stream.py).
After each step the engine waits for that round alone (`updates.flush()`), and the round's wall time
(`updates.last_duration_s`) is set beside the time of one `adamw_step` over the same number of parameters in
one set of NumPy arrays, on the same threads, after as many calls. The round's excess over the flat call is
what the engine adds to the kernel: the per-layer calls and segments, the host state's pages, the update
thread.

    python benchmarks/cpu_adamw/engine_round.py [--hidden 1024] [--layers 8] [--vocab 151936] [--steps 5] \
        [--device cpu] [--out results/DATE-WHAT.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks.common`
from benchmarks.common.records import add_allow_dirty, commit_stamp, host_description, write_records  # noqa: E402
from benchmarks.cpu_adamw.in_step import State  # noqa: E402

import slidedp  # noqa: E402

SEQ_LEN = 64  # tokens a step: the forward and backward stay short beside the round


def qwen3_like(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                                        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 256),
                                        head_dim=128, vocab_size=vocab, tie_word_embeddings=True))


def engine_rounds(model: torch.nn.Module, steps: int, device: str) -> tuple[list[float], int, int | None]:
    """The wall time of each step's round of host updates, waited for alone; the parameters a round updates
    and its threads (None: numba's default)."""
    engine = slidedp.compile(model, "4GiB", batch_size=1, seq_len=SEQ_LEN, device=device, precision="bf16",
                             max_grad_norm=1.0)
    try:
        if engine.plan.schedule.device_state or engine.plan.schedule.streamed_updates:
            raise SystemExit("the plan updates some layers on the device: the round would not cover every layer")
        ids = torch.randint(0, model.config.vocab_size, (1, SEQ_LEN))
        rounds = []
        for _ in range(steps):
            engine.step(ids)
            engine.updates.flush()
            rounds.append(engine.updates.last_duration_s)
        return rounds, sum(layer.numel for layer in engine.graph.layers), engine.runner.updates.num_threads
    finally:
        engine.close()


def flat_calls(numel: int, calls: int, threads: int | None) -> list[float]:
    """The wall time of `calls` AdamW steps over `numel` parameters in one set of NumPy arrays (bf16
    gradient in, bf16 weights out, as a round's: in_step.py's State)."""
    state = State(numel, memfd=False)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        state.step(threads)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 256)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--steps", type=int, default=5, help="steps (the first, with its compilations, is not compared)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="the record to write")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    if args.hidden % 256 or args.steps < 2:
        p.error("--hidden must be a multiple of 256 and --steps at least 2")
    stamp = commit_stamp(args.allow_dirty)
    rounds, numel, threads = engine_rounds(qwen3_like(args.hidden, args.layers, args.vocab), args.steps, args.device)
    flat = flat_calls(numel, args.steps, threads)
    round_s, flat_s = statistics.median(rounds[1:]), statistics.median(flat[1:])
    print(f"{numel / 1e6:.1f} M parameters, threads {threads or 'default'}: the engine's round {round_s:.4f} s "
          f"(steps {', '.join(f'{r:.3f}' for r in rounds)}), one call {flat_s:.4f} s; round / call {round_s / flat_s:.3f}")
    if args.out:
        write_records(args.out, {**stamp, "command": "python " + " ".join(sys.argv), "host": host_description(),
                                 "device": args.device, "hidden": args.hidden, "layers": args.layers,
                                 "vocab": args.vocab, "params": numel, "threads": threads, "round_s": rounds,
                                 "flat_call_s": flat, "round_over_call": round_s / flat_s})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
