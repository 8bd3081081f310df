"""The planner is a leaf: from openk3 it imports only the config, the cache byte specs and the shared checks, and never torch."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[2] / "openk3" / "planner"
ALLOWED = ("openk3.config", "openk3.serve.cache.spec", "openk3.checks", "openk3.planner")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_planner_imports_only_config_and_cache_spec() -> None:
    bad = []
    for path in PLANNER.rglob("*.py"):
        for name in _imports(path):
            if name.split(".")[0] == "torch":
                bad.append(f"{path.name}: {name}")
            if name.startswith("openk3") and not any(name == a or name.startswith(a + ".") for a in ALLOWED):
                bad.append(f"{path.name}: {name}")
    assert bad == []


def test_checker_sees_a_bad_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("def f():\n    import torch.cuda\n    from openk3.model import model\n")
    assert _imports(f) == ["torch.cuda", "openk3.model"]
