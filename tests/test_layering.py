"""The repository's layering rules, checked on the source tree.

* ``verl/`` (the generic RL core) imports nothing from the packages built on it (``recurrent``, ``taskutils``,
  ``recipe``, ``serve``): workflows reach the trainer through ``verl/trainer/ppo/workflow.py``;
* no source module is longer than 800 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPPER_LAYERS = ("recurrent", "taskutils", "recipe", "serve", "scripts", "quickstart")
MAX_LINES = 800


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def test_core_imports_no_upper_layer():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: import {name}"
        for path in sorted((ROOT / "verl").rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] in UPPER_LAYERS
    ]
    assert bad == [], "verl/ must not import the layers built on it:\n" + "\n".join(bad)


def test_layering_check_sees_nested_imports(tmp_path):
    """The walker finds imports inside functions too (a lazy import is still a dependency)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from recurrent.interface import load_register\n")
    assert _imports(module) == [(2, "recurrent.interface")]


def test_no_module_over_800_lines():
    packages = ("verl", "recurrent", "taskutils", "recipe", "serve", "scripts", "benchmarks")
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for pkg in packages
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert long == [], "split these modules:\n" + "\n".join(long)
