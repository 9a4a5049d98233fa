"""Device-memory budgets: `slidedp.Budget`, bytes, or strings such as "24GiB" / "40 GB"."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# The largest budget accepted: 1 EiB a GPU, far beyond any device, and small enough that every sum
# of the solver's integer model (int64 bytes, scheduler/search/cpsat.py) stays representable.
MAX_BUDGET_BYTES = 2**60

_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class Budget:
    """Per-GPU device-memory budget in bytes."""

    device_bytes: int

    def __post_init__(self):
        if isinstance(self.device_bytes, bool) or not isinstance(self.device_bytes, int):
            raise TypeError(f"Budget.device_bytes must be an int, got {type(self.device_bytes).__name__}")
        if self.device_bytes <= 0:
            raise ValueError(f"budget must be positive, got {self.device_bytes} bytes")
        if self.device_bytes > MAX_BUDGET_BYTES:
            raise ValueError(f"budget {_digits(self.device_bytes)} bytes is above the largest accepted, "
                             f"{MAX_BUDGET_BYTES} bytes (2**60, 1 EiB) a GPU")

    @classmethod
    def parse(cls, value: "Budget | int | str") -> "Budget":
        """Accept a Budget, a positive int of bytes, or a string like "24GiB", "40 GB", "512MiB"."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise TypeError("budget must be a slidedp.Budget, bytes (int) or a string like '24GiB', got bool")
        if isinstance(value, int):
            return cls(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"budget must be a finite number of bytes, got {value}")
            if not value.is_integer():
                raise ValueError(f"budget in bytes must be a whole number, got {value}")
            return cls(int(value))
        if isinstance(value, str):
            m = _PATTERN.match(value)
            unit = m.group(2).lower() if m else None
            if m is None or unit not in _UNITS:
                raise ValueError(
                    f"cannot parse budget {value!r}: expected a number with an optional unit "
                    "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '24GiB'"
                )
            number = Decimal(m.group(1)) * _UNITS[unit]  # exact: no float overflow for 400 digits
            if number > MAX_BUDGET_BYTES:
                raise ValueError(f"budget {_digits(value.strip())} is above the largest accepted, "
                                 f"{MAX_BUDGET_BYTES} bytes (2**60, 1 EiB) a GPU")
            return cls(int(number))
        raise TypeError(
            f"budget must be a slidedp.Budget, bytes (int) or a string like '24GiB', got {type(value).__name__}"
        )

    def __str__(self) -> str:
        return format_bytes(self.device_bytes)


def parse_with_unit(value, key: str) -> Budget:
    """A budget as the command line and the train config take it: a number with a unit ("24GiB",
    "512MiB", "24000000000B"). A bare number is refused naming `key` (in the Python API an int
    is bytes, but `budget=24` at the command line is meant as 24 GiB far more often than as 24 bytes)."""
    budget = Budget.parse(value if isinstance(value, str) else str(value))
    m = _PATTERN.match(str(value))
    if m is not None and not m.group(2):
        raise ValueError(f"{key} {str(value).strip()} has no unit: write {str(value).strip()}GiB (or MiB, GB, ..., "
                         f"B for bytes)")
    return budget


def _digits(value) -> str:
    """A value for a message, cut short when it is hundreds of digits long."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
