"""Run by test_torchrun.py under `torchrun --nproc-per-node=W`: every process is one rank.

    torchrun --nproc-per-node=2 tests/multirank/torchrun_job.py OUT_DIR
"""

import os
import sys

import torch
from safetensors.torch import save_file

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD
from tests.models import VOCAB, make_model


def main(out_dir: str) -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    model = make_model("llama", tied=True)  # every rank builds the same model; rank 0's weights are used
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=world_size, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD),
                             max_grad_norm=CLIP)
    gen = torch.Generator().manual_seed(1)
    losses = []
    with engine:
        for step in range(3):
            ids = torch.randint(0, VOCAB, (world_size * BATCH * 2, SEQ), generator=gen)  # the same global batch everywhere
            losses.append(engine.step(ids))
            if step == 1:
                engine.save_checkpoint(os.path.join(out_dir, "checkpoint"))
        state = engine.state_dict()
    if int(os.environ["RANK"]) == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(out_dir, "state.safetensors"))
        save_file({"losses": torch.tensor(losses, dtype=torch.float64)}, os.path.join(out_dir, "losses.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
