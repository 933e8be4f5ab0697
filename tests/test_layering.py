"""The package's layers (DESIGN.md §1), written once here: arrows point down only, and no module of
the package imports itself back through others (no cycles, not even through function-local
imports). Nothing but the tests imports tpkernels.testing."""

from __future__ import annotations

import ast
from pathlib import Path

import tpkernels

ROOT = Path(tpkernels.__file__).parent
# top to bottom: a module may import its own layer and the layers below it
LAYERS = ["cli", "info", "train", "generate", "data", "planner", "hf", "models", "pipeline", "nn", "functional",
          "kernels", "quant", "parallel", "description"]
# leaf modules every layer may use (they import none of the layers)
SHARED = {"backends", "conventions", "env_vars", "options", "dtypes", "live_bytes", "_state", "_extension", "_lazy", "_version", "_C"}  # _C: compiled
# what the planner may use: the layout rules, the model description, the schedules' simulator
PLANNER_USES = {"planner", "parallel", "pipeline", "description"} | SHARED


def _imports(path: Path) -> set[str]:
    """The full tpkernels module names a file imports (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n for n in names if n.split(".")[0] == "tpkernels"}
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if _layer(m) not in set(LAYERS) | SHARED | {"testing", "__main__"}
                      and m != "tpkernels")
    assert not unplaced, f"modules outside the layer order (add them to LAYERS or SHARED): {unplaced}"


def test_arrows_point_down():
    wrong = []
    for mod, path in MODULES.items():
        layer = _layer(mod)
        if layer not in LAYERS and layer not in SHARED:
            continue
        allowed = (set(LAYERS[LAYERS.index(layer):]) if layer in LAYERS else set()) | SHARED
        for target in {_layer(t) for t in _imports(path)} - {None}:
            if target not in allowed and target != layer:
                wrong.append(f"{mod} ({layer}) imports tpkernels.{target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_shared_leaves_import_no_layer():
    for name in SHARED - {"_C"}:
        path = MODULES.get(f"tpkernels.{name}")
        assert path is not None, name
        used = {_layer(t) for t in _imports(path)} - {None}
        assert used <= SHARED, (name, used)


def test_no_import_cycles():
    """Module-level and function-local imports alike: a cycle means two modules that cannot be
    understood (or imported) one without the other."""
    graph = {}
    for mod, path in MODULES.items():
        targets = set()
        for t in _imports(path):
            while t and t not in MODULES:  # "from tpkernels.x import name": the module is tpkernels.x
                t = t.rpartition(".")[0]
            if t and t != mod and not mod.startswith(t + "."):  # a package's __init__ is not a cycle with it
                targets.add(t)
        graph[mod] = targets
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t.startswith(m + "."):
                continue
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif state.get(t) is None:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if state.get(m) is None:
            visit(m, [m])
    real = [c for c in cycles if not all(x == c[0] or x.startswith(c[0] + ".") or c[0].startswith(x + ".")
                                         for x in c)]
    assert not real, "\n".join(" -> ".join(c) for c in real)


def test_only_tests_import_the_test_helpers():
    users = [m for m, p in MODULES.items() if _layer(m) != "testing" and "testing" in {_layer(t) for t in _imports(p)}]
    assert users == []
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    assert [p.name for p in benchmarks.glob("*.py") if "testing" in {_layer(t) for t in _imports(p)}] == []


def test_planner_uses_only_the_layout_rules_the_description_and_the_simulator():
    used = set()
    for mod, path in MODULES.items():
        if _layer(mod) == "planner":
            used |= {_layer(t) for t in _imports(path)} - {None}
    assert used <= PLANNER_USES, used - PLANNER_USES


def test_package_data_ships_with_the_package():
    """What the package reads at run time lives inside it (a non-editable install has no repository)."""
    offenders = []
    for mod, path in MODULES.items():
        text = path.read_text()
        if "parents[2]" in text or '"benchmarks"' in text or "'benchmarks'" in text:
            offenders.append(mod)
    assert not offenders, offenders
