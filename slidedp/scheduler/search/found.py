"""What every search strategy returns, so that all of them compare the same way.

A strategy is a function `search(costs, budget_bytes, start) -> Found | None`: from the problem's
costs, the device budget and a starting point (None where it needs none), the decisions it found
with their simulated step (the oracle every strategy is judged by), or None when it finds nothing
that fits. `by` names the search; `solve` credits a plan's decisions to the `by` of the Found it
kept, so a decision is never credited to CP-SAT unless CP-SAT made it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slidedp.scheduler.decisions import Decisions
from slidedp.scheduler.oracles.timeline import Simulation


@dataclass(frozen=True)
class Found:
    by: str  # "cp-sat", "baseline:greedy", "local-search", "early updates", "streamed updates", ...
    decisions: Decisions
    simulation: Simulation
    tried: dict = field(default_factory=dict)  # the searched value -> its step [s], for sweeps

    @property
    def makespan(self) -> int:
        """Simulated step time [ticks]."""
        return self.simulation.makespan


def fastest(found: list[Found]) -> Found | None:
    """Fastest, then least memory, then the first listed (list the heuristics before CP-SAT, so that
    a tie credits the heuristic: CP-SAT then found nothing better)."""
    if not found:
        return None
    return min(enumerate(found), key=lambda t: (t[1].makespan, t[1].simulation.peak_bytes, t[0]))[1]
