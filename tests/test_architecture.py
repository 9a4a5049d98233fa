"""The package's house rules, read from its own imports: one-way flow between stages, no circles.

Stages, from the bottom up (model → IR → costs → plan → program → run): a module may import its own
stage and the stages below it, never one above. Stages on the same floor do not import each other.
Every import counts, also one inside a function.
"""

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "slidedp"

# floor -> stages (a stage is a module or a package prefix under slidedp)
FLOORS = (
    ("_version", "errors", "budget", "optim", "logs"),  # plain types every stage shares; its logger
    ("options",),                                  # CompileOptions (holds an AdamW)
    ("ir",),                                       # model -> layer IR
    ("costmodel",),                                # hardware, memory and time of operations
    ("scheduler.plan",),                           # the Plan: plain data (schedule + explanation)
    ("scheduler",),                                # problem, oracles, search strategies, solve
    ("backend", "report"),                         # lowering + runtime; presentation of plans
    ("run",),                                      # engine, checkpoints, preflight, weights
    ("api",),                                      # compile / plan as a call of named stages
    ("profiler", "train"),                         # calibrate + bench; the train job
    ("cli",),                                      # the command line
    ("__main__", ""),                              # python -m slidedp; the package's front door
)
# sub-stages inside a stage, bottom up
SUB_FLOORS = {
    # replay above solve: a plan's edited twin is laid out and explained by solve.plan_for
    "scheduler": (("plan", "decisions"), ("problem",), ("oracles",), ("search",), ("explain",), ("solve",),
                  ("replay",)),
    "backend": (("kernels", "state"), ("lowering",), ("runtime",)),
}

# What other stages may import of a stage (its surface), by importer; "*": every other stage.
SURFACES = {
    "scheduler": {"*": ("scheduler.plan",), "": ("scheduler.plan", "scheduler.decisions"),
                  "api": ("scheduler.plan", "scheduler.decisions", "scheduler.solve", "scheduler.replay",
                          "scheduler.search.micro_rows")},  # the sweep around whole solves (group_rows)
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    """slidedp-internal modules (or names) that `path` imports, as dotted names under slidedp."""
    name = _module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["slidedp", *name.split(".")][: -node.level] if path.name != "__init__.py" else \
                    ["slidedp", *name.split(".")][: len(name.split(".")) + 1 - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names]  # a submodule, or a name of `module`
        else:
            continue
        out |= {t[len("slidedp."):] if t != "slidedp" else "" for t in targets if t == "slidedp" or t.startswith("slidedp.")}
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(target: str, modules) -> str:
    """The module a dotted import target names (a name imported from a module: that module)."""
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _stage(module: str, floors) -> tuple[int, str]:
    best = None
    for floor, stages in enumerate(floors):
        for stage in stages:
            if module == stage or (stage and module.startswith(stage + ".")):
                if best is None or len(stage) > len(best[1]):
                    best = (floor, stage)
    assert best is not None, f"{module} belongs to no stage: add it to FLOORS or SUB_FLOORS"
    return best


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path):
            target = _resolve(target, modules)
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def _upward(graph: nx.DiGraph) -> list[str]:
    bad = []
    for a, b in graph.edges:
        fa, sa = _stage(a, FLOORS)
        fb, sb = _stage(b, FLOORS)
        if fb > fa or (fb == fa and sa != sb):
            bad.append(f"slidedp.{a} (floor {fa}, {sa or 'slidedp'}) imports slidedp.{b} (floor {fb}, {sb or 'slidedp'})")
        elif sa == sb and sa in SUB_FLOORS and a != sa and b != sa:
            (ga, pa), (gb, pb) = _stage(a[len(sa) + 1:], SUB_FLOORS[sa]), _stage(b[len(sb) + 1:], SUB_FLOORS[sa])
            if gb > ga or (gb == ga and pa != pb):
                bad.append(f"slidedp.{a} ({sa}.{pa}) imports slidedp.{b} ({sa}.{pb}), not below it")
    return bad


def _outside_surface(graph: nx.DiGraph) -> list[str]:
    bad = []
    for a, b in graph.edges:
        _, sa = _stage(a, FLOORS)
        owner = next((o for o in SURFACES if b == o or b.startswith(o + ".")), None)
        if owner is None or a == owner or a.startswith(owner + "."):
            continue
        allowed = SURFACES[owner].get(sa, SURFACES[owner]["*"])
        if not any(b == m or b.startswith(m + ".") for m in allowed):
            bad.append(f"slidedp.{a} imports slidedp.{b}: outside {owner}'s surface {allowed}")
    return bad


def test_every_module_belongs_to_a_stage():
    for name in _modules():
        _, stage = _stage(name, FLOORS)
        if stage in SUB_FLOORS and name != stage:
            _stage(name[len(stage) + 1:], SUB_FLOORS[stage])


def test_no_import_runs_up_the_stages():
    assert _upward(import_graph()) == []


def test_other_stages_read_the_scheduler_only_through_the_plan():
    assert _outside_surface(import_graph()) == []


def test_no_circle_of_imports():
    graph = import_graph()
    graph.remove_nodes_from([""])  # the package itself re-exports; nothing inside imports it
    assert list(nx.simple_cycles(graph)) == []


def test_the_rules_catch_what_they_forbid():
    """The checks can fail: each forbidden arrow, added to the real graph, is named."""
    graph = import_graph()
    graph.add_edge("ir.graph", "scheduler.solve")  # up the stages
    graph.add_edge("scheduler.problem.costs", "scheduler.search.cpsat")  # up inside a stage
    graph.add_edge("backend.lowering.weight_window", "scheduler.problem.lanes")  # past the Plan
    bad = _upward(graph) + _outside_surface(graph)
    for a, b in [("ir.graph", "scheduler.solve"), ("scheduler.problem.costs", "scheduler.search.cpsat"),
                 ("backend.lowering.weight_window", "scheduler.problem.lanes")]:
        assert any(f"slidedp.{a} " in line and f"slidedp.{b}" in line for line in bad), (a, b, bad)
    graph.add_edge("ir.graph", "ir.build")
    graph.add_edge("ir.build", "ir.graph")
    assert ["ir.build", "ir.graph"] in [sorted(c) for c in nx.simple_cycles(graph)]


def _loaded_after(module: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter has in sys.modules after importing `module`."""
    code = f"import sys, {module}; print(' '.join(n for n in {names!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    return out.stdout.split()


def test_worker_processes_do_not_load_the_solver():
    """A rank's process imports the workers module; the solver (OR-Tools) is the controller's alone."""
    assert _loaded_after("slidedp.backend.runtime.workers", ("ortools", "slidedp.scheduler.solve")) == []


def test_the_command_line_starts_without_torch_or_the_solver():
    assert _loaded_after("slidedp.cli", ("torch", "transformers", "ortools")) == []
