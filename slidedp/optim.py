"""Optimizer settings. The update itself runs on the CPU (slidedp/backend/kernels/cpu_adamw.py)."""

from __future__ import annotations

import math
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
        """Each argument checked, as the config checks its keys: ValueError / TypeError naming it."""
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"AdamW betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        b1, b2 = self.betas
        for name, value in (("lr", self.lr), ("betas[0]", b1), ("betas[1]", b2), ("eps", self.eps),
                            ("weight_decay", self.weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"AdamW {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"AdamW {name} must be finite, got {value!r}")
        checks = {
            "lr": (self.lr >= 0.0, ">= 0"),
            "betas[0]": (0.0 <= b1 < 1.0, "in [0, 1)"),
            "betas[1]": (0.0 <= b2 < 1.0, "in [0, 1)"),
            "eps": (self.eps > 0.0, "> 0 (it keeps the update's division finite)"),
            "weight_decay": (self.weight_decay >= 0.0, ">= 0"),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                value = {"lr": self.lr, "betas[0]": b1, "betas[1]": b2, "eps": self.eps,
                         "weight_decay": self.weight_decay}[name]
                raise ValueError(f"AdamW {name} must be {rule}, got {value!r}")
        if not isinstance(self.no_decay_groups, bool):
            raise TypeError(f"AdamW no_decay_groups must be True or False, got {self.no_decay_groups!r}")

    def to_dict(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "no_decay_groups": self.no_decay_groups}
