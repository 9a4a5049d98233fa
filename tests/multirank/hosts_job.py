"""Run by test_hosts.py as N "hosts" on one machine, each `torchrun --nnodes N --node-rank k
--nproc-per-node G`: every host's first rank makes its own host state, holding the chunks its ranks own.

    torchrun --nnodes 2 --node-rank K --nproc-per-node G --master-addr 127.0.0.1 --master-port P \\
        tests/multirank/hosts_job.py OUT_DIR [ONE_HOST_CHECKPOINT | --until-killed | --vocab | --vocab-tied | --streamed-gradients]

Steps on the batches of `batches(world_size)`: step 1 is poisoned on the last host (its block 1 gives
nan), so every rank skips it; a checkpoint after step 2, reloaded for step 3 again. Given a
checkpoint of one host, it is loaded, saved again and trained one more step (resharding 1 -> N).
With --until-killed the hosts train until the test kills one. With --vocab an untied model's
(--vocab-tied: a tied model's) embedding and head stream by vocabulary chunk (sharded delivery, GPU reduction) for three steps;
with --streamed-gradients every gradient streams into its update (no clipping) for three steps.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

import slidedp
from tests.engine.test_exactness import BATCH, CLIP, LR, SEQ, WD
from tests.models import VOCAB, make_model
from tests.multirank.test_data_parallel import routed_plan

POISONED = 1  # the step whose gradient is not finite


def batches(world_size: int, n: int = 5, passes: int = 1) -> list[torch.Tensor]:
    """Global batches of two micro-batches per rank each (gradient accumulation), times `passes`."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world_size * BATCH * 2 * passes, SEQ), generator=gen) for _ in range(n)]


def poison(model, switch: dict):
    def hook(module, args, output):
        if not switch["on"]:
            return None
        out = output[0] if isinstance(output, tuple) else output
        return (out * float("nan"), *output[1:]) if isinstance(output, tuple) else out * float("nan")

    return model.model.layers[1].register_forward_hook(hook)


def vocab_streamed(out_dir: str, world_size: int, hosts: int, rank: int, tied: bool = False) -> None:
    """Three steps with the embedding and head (`tied`: one table) streamed by row chunks; rank 0 writes
    the losses and the state (vocab_result.json, vocab_state.safetensors)."""
    from tests.engine.test_vocab_stream import CHUNK_NUMEL

    model = make_model("llama", tied=tied)
    plan = routed_plan(model, world_size, ("sharded", "gpu"), micro_batches=2, hosts=hosts,
                       vocab_streamed=("prologue", "epilogue"), vocab_chunk_numel=CHUNK_NUMEL)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=world_size, micro_batches=2, plan=plan,
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), max_grad_norm=CLIP)
    data = batches(world_size, 3, passes=2)
    with engine:
        losses = [engine.step(ids) for ids in data]
        clip = engine.last_step.clip_coef
        held = [layout.held_numel for layout in engine.host.layouts]
        state = engine.state_dict()
    if rank == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(out_dir, "vocab_state.safetensors"))
        with open(os.path.join(out_dir, "vocab_result.json"), "w") as f:
            json.dump(dict(losses=losses, clip_coef=clip, held_numels=held, vocab_chunk_rows=plan.vocab_chunk_rows,
                           edges=[[d.activation, d.delivery, d.reduction, d.numel]
                                  for d in plan.decisions if d.kind != "block"]), f)


def streamed_gradients(out_dir: str, world_size: int, hosts: int, rank: int) -> None:
    """Three steps with every gradient streamed into its update (no clipping, nonfinite="stop"): each
    owner applies its chunks on its own host as they land; rank 0 writes the losses and the state
    (grads_result.json, grads_state.safetensors)."""
    from tests.engine.test_streamed_gradients import landing_order

    model = make_model("llama")
    plan = routed_plan(model, world_size, ("sharded", "gpu"), micro_batches=2, hosts=hosts)
    plan = plan.replace(early_order=tuple(landing_order(len(plan.decisions))), streamed_gradients=True)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=world_size, micro_batches=2, plan=plan, nonfinite="stop",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD))
    with engine:
        no_grads = all(layer.grad is None for layer in engine.host.layers)
        losses = [engine.step(ids) for ids in batches(world_size, 3)]
        state = engine.state_dict()
    if rank == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(out_dir, "grads_state.safetensors"))
        with open(os.path.join(out_dir, "grads_result.json"), "w") as f:
            json.dump(dict(losses=losses, no_host_gradient=no_grads), f)


def main(out_dir: str, extra: str | None) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    hosts = world_size // int(os.environ["LOCAL_WORLD_SIZE"])
    if extra in ("--vocab", "--vocab-tied"):
        vocab_streamed(out_dir, world_size, hosts, rank, tied=extra == "--vocab-tied")
        return
    if extra == "--streamed-gradients":
        streamed_gradients(out_dir, world_size, hosts, rank)
        return
    model = make_model("llama", tied=True)  # every rank builds the same model
    switch = {"on": False}
    if int(os.environ["GROUP_RANK"]) == hosts - 1:
        poison(model, switch)
    plan = routed_plan(model, world_size, ("sharded", "gpu"), micro_batches=1, hosts=hosts)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             world_size=world_size, plan=plan, optimizer=slidedp.AdamW(lr=LR, weight_decay=WD),
                             max_grad_norm=CLIP)
    data = batches(world_size)
    comm = engine.runner.comm
    if extra == "--until-killed":
        with engine:
            for step in range(10**6):
                engine.step(data[step % 2 * 2])
                if step == 1 and rank == world_size - 1:
                    open(os.path.join(out_dir, "training"), "w").close()
        return
    memory = comm.all_gather(dict(host=comm.host_index, state_bytes=engine.host.nbytes,
                                  allocated_bytes=engine.host.allocated_bytes(),
                                  held_numels=[layout.held_numel for layout in engine.host.layouts]))
    two = os.path.join(out_dir, "two-hosts")
    losses, skipped = [], []
    with engine:
        for step in range(4):
            switch["on"] = step == POISONED
            losses.append(engine.step(data[step]))
            skipped.append(engine.last_step.skipped)
            switch["on"] = False
            if step == 2:
                engine.save_checkpoint(two)
        state = engine.state_dict()
        engine.load_checkpoint(two)
        again = engine.step(data[3])
        state_again = engine.state_dict()
        from_one = {}
        if extra is not None:  # a checkpoint of one host: loaded here, saved again, one more step
            engine.load_checkpoint(extra)
            engine.save_checkpoint(os.path.join(out_dir, "one-resaved"))
            losses.append(engine.step(data[4]))
            from_one = engine.state_dict()
    if rank == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(out_dir, "state.safetensors"))
        save_file({k: v.clone() for k, v in state_again.items()}, os.path.join(out_dir, "state_again.safetensors"))
        if from_one:
            save_file({k: v.clone() for k, v in from_one.items()}, os.path.join(out_dir, "from_one.safetensors"))
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(dict(losses=losses, again=again, skipped=skipped, memory=memory,
                           plan_host_memory=plan.host_memory), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
