"""`slidedp train`: load a model and data, compile, run the steps, write metrics and weights."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from slidedp.train.config import TrainConfig


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_model_and_tokenizer(cfg: TrainConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.model == "smollm2":
        from slidedp.train.smollm2 import ensure_smollm2

        folder = ensure_smollm2()
    else:
        folder = Path(cfg.model)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"config key 'model': {cfg.model} is not a Hugging Face folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def load_data(cfg: TrainConfig, tokenizer):
    from slidedp.train.data import PackedDataset, stdlib_dataset

    if cfg.data == "stdlib":
        return stdlib_dataset(tokenizer, cfg.seq_len, max_rows=cfg.max_rows, seed=cfg.seed)
    path = Path(cfg.data)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(f"config key 'data': no .txt files at {cfg.data}")
    return PackedDataset.from_docs(files, tokenizer, cfg.seq_len, max_rows=cfg.max_rows, seed=cfg.seed)


def run(cfg: TrainConfig) -> dict:
    import slidedp

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    torch.manual_seed(cfg.seed)

    _log(f"[slidedp] loading model {cfg.model}")
    model, tokenizer = load_model_and_tokenizer(cfg)
    _log(f"[slidedp] packing data {cfg.data}: {cfg.max_rows} rows x {cfg.seq_len} tokens")
    data = load_data(cfg, tokenizer)
    rows_per_step = cfg.batch_size * cfg.grad_accum * cfg.world_size
    _log(f"[slidedp] compiling for {device} ({precision}), budget {cfg.budget}")
    engine = slidedp.compile(
        model, cfg.budget, batch_size=cfg.batch_size, seq_len=cfg.seq_len, world_size=cfg.world_size,
        device=device, precision=precision, micro_batches=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm or None,
        optimizer=slidedp.AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay),
    )
    _log(engine.plan.summary())
    metrics_path = out / "metrics.jsonl"
    history = []
    with engine, open(metrics_path, "w") as metrics:
        for step in range(1, cfg.max_steps + 1):
            batch = data.next_batch(rows_per_step)
            t0 = time.perf_counter()
            loss = engine.step(batch)
            step_s = time.perf_counter() - t0
            info = engine.last_step
            record = {
                "step": step, "loss": loss, "grad_norm": info.grad_norm, "lr": cfg.lr, "skipped": info.skipped,
                "tokens_per_s": batch.numel() / step_s, "step_s": step_s,
                "predicted_step_s": engine.plan.predicted_step_time_s, "epoch": data.epoch,
            }
            history.append(record)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                _log(f"step {step:>5}/{cfg.max_steps}  loss {loss:.4f}  grad norm {info.grad_norm:.3f}  "
                     f"lr {cfg.lr:.2e}  {record['tokens_per_s']:.0f} tok/s  step {step_s:.2f}s "
                     f"(predicted {record['predicted_step_s']:.2f}s)")
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in _unique(engine.state_dict()).items()},
                  str(out / "model.safetensors"))
    first, last = history[0]["loss"], history[-1]["loss"]
    _log(f"[slidedp] done: loss {first:.4f} -> {last:.4f}; weights and metrics in {out}")
    return {"first_loss": first, "last_loss": last, "steps": len(history)}


def _unique(state: dict) -> dict:
    """One entry per tensor: safetensors refuses tensors that share memory."""
    seen, out = set(), {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out
