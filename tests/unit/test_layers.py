"""The layers of docs/architecture.md §1 import one way: each package may import only the layers below it, and
only the Airflow layer (operators, dags, plugins) may import Airflow. Checked on the source (every import,
function-level ones included), so a back-arrow fails here rather than in a cycle at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the repository packages it may import
ALLOWED = {
    "core": set(),
    "features": {"core"},
    "training": {"core"},
    "services": {"core"},
    "operators": {"core", "features", "training", "services"},
    "dags": {"core", "operators", "services"},
    "plugins": {"core", "operators", "services", "training"},
}
NO_AIRFLOW = {"core", "features", "training", "services"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        roots = imported_roots(path)
        for other in sorted((roots & set(ALLOWED)) - ALLOWED[package] - {package}):
            wrong.append(f"{path.relative_to(ROOT)} imports {other}")
        if package in NO_AIRFLOW and "airflow" in roots:
            wrong.append(f"{path.relative_to(ROOT)} imports airflow")
    assert not wrong, "back-arrows between layers (docs/architecture.md §1):\n" + "\n".join(wrong)
