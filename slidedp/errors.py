"""slidedp's exceptions. Every one names what was wrong; none leaves anything allocated."""

from __future__ import annotations


class SlidedpError(Exception):
    """Base class of slidedp's own errors."""


class UnsupportedModelError(SlidedpError, TypeError):
    """The model lacks a structure slidedp needs (blocks, logits, ...); the message says which."""


class InfeasibleBudgetError(SlidedpError, ValueError):
    """No schedule fits the device-memory budget.

    `min_budget_bytes` is the smallest budget with which compile succeeds for the same workload.
    """

    def __init__(self, message: str, *, min_budget_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.min_budget_bytes = int(min_budget_bytes)
        self.budget_bytes = int(budget_bytes)


class NonFiniteGradientError(SlidedpError, FloatingPointError):
    """Raised when non-finite gradients repeat more often than allowed."""
