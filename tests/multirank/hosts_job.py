"""Run by test_hosts.py as N "hosts" on one machine, each `torchrun --nnodes N --node-rank k
--nproc-per-node G`: every host's first rank makes its own host state.

    torchrun --nnodes 2 --node-rank K --nproc-per-node 1 --master-addr 127.0.0.1 --master-port P \
        tests/multirank/hosts_job.py OUT_DIR
"""

import os
import sys

import torch
from safetensors.torch import save_file

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD
from tests.models import VOCAB, make_model
from tests.multirank.test_data_parallel import routed_plan


def main(out_dir: str) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model = make_model("llama", tied=True)  # every rank builds the same model
    hosts = world_size // int(os.environ["LOCAL_WORLD_SIZE"])
    plan = routed_plan(model, world_size, ("sharded", "gpu"), micro_batches=1, hosts=hosts)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=world_size, plan=plan, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD),
                             max_grad_norm=CLIP)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (world_size * BATCH * 2, SEQ), generator=gen) for _ in range(3)]
    checkpoint = os.path.join(out_dir, "checkpoint")
    losses = []
    with engine:
        for step, ids in enumerate(batches):  # two passes a step: gradient accumulation on the host
            losses.append(engine.step(ids))
            if step == 1:
                engine.save_checkpoint(checkpoint)
        state = engine.state_dict()
        engine.load_checkpoint(checkpoint)  # read on the first host, shared with the others
        again = engine.step(batches[2])
        state_again = engine.state_dict()
        pid = torch.tensor([os.getpid() if engine.runner.leader else 0])
        torch.distributed.all_reduce(pid, group=engine.runner.comm.host_group)  # every host's state maker
    if rank == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(out_dir, "state.safetensors"))
        save_file({k: v.clone() for k, v in state_again.items()}, os.path.join(out_dir, "state_again.safetensors"))
        save_file({"losses": torch.tensor(losses + [again], dtype=torch.float64)},
                  os.path.join(out_dir, "losses.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
