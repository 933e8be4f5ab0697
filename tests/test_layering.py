"""The package's layers (DESIGN.md §1): arrows point down only. A lower layer never imports a higher
one, and nothing but the tests imports tpkernels.testing."""

from __future__ import annotations

import ast
from pathlib import Path

import tpkernels

ROOT = Path(tpkernels.__file__).parent
# top to bottom; a module may import its own layer and the ones below it
LAYERS = ["train", "models", "pipeline", "nn", "functional", "kernels", "parallel"]
SHARED = {"backends", "dtypes", "_state", "_extension", "_version"}  # leaf modules every layer may use
# the planner sits beside the stack on parallel/ only; models read its one preset list, train its plans
BESIDE = {"models": {"planner"}, "train": {"planner"}}


def _imports(path: Path) -> set[str]:
    """The tpkernels.<top> names a file imports (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "tpkernels" and len(parts) > 1:
                out.add(parts[1])
    return out


def _layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def test_arrows_point_down():
    wrong = []
    for path in ROOT.rglob("*.py"):
        layer = _layer_of(path)
        if layer not in LAYERS:
            continue
        allowed = set(LAYERS[LAYERS.index(layer):]) | SHARED | BESIDE.get(layer, set())
        for target in _imports(path) - allowed:
            if target in LAYERS or target in ("testing", "planner", "cli", "info"):
                wrong.append(f"{path.relative_to(ROOT)} ({layer}) imports tpkernels.{target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_only_tests_import_the_test_helpers():
    users = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
             if _layer_of(p) != "testing" and "testing" in _imports(p)]
    assert users == []
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    assert [p.name for p in benchmarks.glob("*.py") if "testing" in _imports(p)] == []


def test_planner_uses_only_the_layout_rules_and_the_rank_pool():
    # the planner reads ParallelConfig (its rules) and times a collective with the local rank pool
    used = set()
    for path in (ROOT / "planner").rglob("*.py"):
        used |= _imports(path)
    assert used <= {"planner", "parallel", "pipeline"}, used
