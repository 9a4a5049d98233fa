"""The epilogue fuses head + cross-entropy when the model's logits are the head's plain output, and
falls back to the model's own logits when the forward changes them; exact either way."""

import copy

import pytest
import torch

import slidedp
from tests.engine.test_exactness import BATCH, LR, SEQ, WD, random_batch, reference_loss
from tests.models import PlainLM


class HeadedLM(PlainLM):
    """PlainLM that names its head like a Hugging Face model, optionally scaling the logits after it."""

    def __init__(self, logit_scale: float | None, tied: bool):
        super().__init__(tied=tied)
        self.logit_scale = logit_scale

    def get_output_embeddings(self):
        return self.out

    def forward(self, input_ids):
        logits = super().forward(input_ids)
        return logits if self.logit_scale is None else logits * self.logit_scale


@pytest.mark.parametrize("logit_scale, fused", [(None, True), (0.5, False)])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_only_for_a_plain_head_and_exact_both_ways(logit_scale, fused, tied):
    """Gradients of every parameter (tied head included) equal autograd on the plain model to fp32
    rounding, and the losses of three AdamW steps agree. (Weights after several steps are compared
    in test_exactness.py; here the fused sum order moves near-zero gradient entries by ~1e-12,
    which Adam's normalisation can turn into visible weight differences, so gradients are the
    precise check.)"""
    torch.manual_seed(0)
    model = HeadedLM(logit_scale, tied)
    ref = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    engine = slidedp.compile(model, "1GiB", batch_size=BATCH, seq_len=SEQ, device="cpu", precision="fp32",
                             optimizer=slidedp.AdamW(lr=LR, weight_decay=WD), micro_batches=2)
    gen = torch.Generator().manual_seed(11)
    with engine:
        for step in range(3):
            ids, labels = random_batch(gen, 2 * BATCH)
            loss = engine.step(ids, labels)
            opt.zero_grad()
            ref_loss = reference_loss(ref, ids, labels)
            ref_loss.backward()
            assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
            if step == 0:
                engine.updates.flush()
                for layer in engine.graph.layers:
                    host = engine.host.layers[layer.id]
                    grads = host.param_views(host.grad)
                    for p in layer.params:
                        want = ref.get_parameter(p.name).grad
                        assert (grads[p.name] - want).norm() <= 1e-5 * want.norm() + 1e-12, p.name
            opt.step()
        assert engine.executor.fused_head is fused
