"""slidedp: full-parameter fine-tuning of models larger than GPU memory.

The fp32 master weights and AdamW moments live once in host RAM; layers stream through the GPU
and gradients stream back to a CPU optimizer. `compile(model, budget, ...)` traces the model into
a layer IR, plans a schedule under the device-memory budget and returns an Engine.
"""

from slidedp._version import __version__  # noqa: E402,F401

from slidedp.budget import Budget  # noqa: E402
from slidedp.costmodel.hardware import Hardware  # noqa: E402
from slidedp.errors import (  # noqa: E402
    HostLostError, InfeasibleBudgetError, NonFiniteGradientError, SlidedpError, UnsupportedModelError, WorkerError,
)
from slidedp.optim import AdamW  # noqa: E402
from slidedp.options import CompileOptions  # noqa: E402
from slidedp.scheduler.decisions import SolverOptions  # noqa: E402
from slidedp.scheduler.plan import Plan  # noqa: E402


def __getattr__(name: str):
    # `compile` and `plan` bring in the solver (OR-Tools); worker processes, which only run a
    # plan, import slidedp without it.
    if name in ("compile", "plan", "predict", "Engine"):
        from slidedp import api

        return getattr(api, name)
    raise AttributeError(f"module 'slidedp' has no attribute {name!r}")


__all__ = [
    "AdamW", "Budget", "CompileOptions", "Engine", "Hardware", "HostLostError", "InfeasibleBudgetError",
    "NonFiniteGradientError", "Plan", "SlidedpError", "SolverOptions",
    "UnsupportedModelError", "WorkerError", "compile", "plan", "predict", "__version__",
]
