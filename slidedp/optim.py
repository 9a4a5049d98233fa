"""Optimizer settings. The update itself runs on the CPU (slidedp/backend/kernels/cpu_adamw.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamW:
    """AdamW exactly as torch.optim.AdamW: decoupled weight decay, bias correction.

    `no_decay_groups=True` exempts norms, biases and embeddings from weight decay.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay_groups: bool = False

    def __post_init__(self):
        b1, b2 = self.betas
        checks = {
            "lr": self.lr >= 0.0,
            "betas[0]": 0.0 <= b1 < 1.0,
            "betas[1]": 0.0 <= b2 < 1.0,
            "eps": self.eps >= 0.0,
            "weight_decay": self.weight_decay >= 0.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid AdamW {name}: lr={self.lr}, betas={self.betas}, eps={self.eps}, "
                                 f"weight_decay={self.weight_decay}")

    def to_dict(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "no_decay_groups": self.no_decay_groups}
