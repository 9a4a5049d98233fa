"""`slidedp` with faults injected for the reliability tests (never imported by slidedp itself).

Environment variables choose the fault:

- SLIDEDP_FAULT_SIGNAL_AT_STEP=N and SLIDEDP_FAULT_SIGNAL=SIGINT|SIGTERM: the process sends itself
  the signal in the middle of optimizer step N (after the engine was entered, before it returns).
- SLIDEDP_FAULT_PAUSE_SAVE_AT_STEP=N and SLIDEDP_FAULT_MARKER=PATH: while the checkpoint of step N
  is written, after its first layer file, PATH is created and the process sleeps (for the test to
  SIGKILL it there).
"""

import os
import signal
import sys
import time
from pathlib import Path


def install() -> None:
    import slidedp.run.checkpoint as ckpt
    import slidedp.run.engine as engine_mod
    import slidedp.train.job as job

    signal_at = int(os.environ.get("SLIDEDP_FAULT_SIGNAL_AT_STEP", "0"))
    if signal_at:
        signum = getattr(signal, os.environ.get("SLIDEDP_FAULT_SIGNAL", "SIGINT"))
        original_step = engine_mod.Engine.step
        calls = {"n": 0}

        def step(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == signal_at:
                os.kill(os.getpid(), signum)  # handled at the next bytecode: inside this step
            return original_step(self, *args, **kwargs)

        engine_mod.Engine.step = step

    pause_at = int(os.environ.get("SLIDEDP_FAULT_PAUSE_SAVE_AT_STEP", "0"))
    if pause_at:
        marker = Path(os.environ["SLIDEDP_FAULT_MARKER"])
        original_save = job.save_run_checkpoint
        original_write = ckpt.write_safetensors
        current = {"step": None}

        def save_run_checkpoint(engine, output_dir, step, *args, **kwargs):
            current["step"] = step
            return original_save(engine, output_dir, step, *args, **kwargs)

        def write_safetensors(path, tensors, metadata=None):
            digest = original_write(path, tensors, metadata)
            if current["step"] == pause_at and "layer-" in Path(path).name:
                marker.write_text(str(path))
                while True:  # half a checkpoint on disk: wait for SIGKILL
                    time.sleep(1)
            return digest

        job.save_run_checkpoint = save_run_checkpoint
        ckpt.write_safetensors = write_safetensors


if __name__ == "__main__":
    install()
    from slidedp.cli import main

    sys.exit(main(sys.argv[1:]))
