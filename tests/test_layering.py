"""Dependencies point one way (api -> serve -> model -> ops); planner and sandbox are leaves that never touch CUDA.

The check walks every module's imports with `ast`, so it also catches imports inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "openk3"

# package -> openk3 subpackages it must never import
FORBIDDEN = {
    "ops": {"model", "serve", "api", "dist", "train", "planner", "sandbox", "cli"},
    "model": {"serve", "api", "dist", "train", "planner", "sandbox", "cli"},
    "serve": {"api", "cli"},
    "planner": {"model", "ops", "api", "dist", "train", "sandbox", "cli"},
    "sandbox": {"model", "ops", "serve", "api", "dist", "train", "planner", "cli"},
}
# planner may import openk3.serve.cache.spec (byte sizes shared with the engine) and nothing else from serve
ALLOWED_EXCEPTIONS = {"planner": {"openk3.serve.cache.spec", "openk3.serve.cache"}}


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue
        owner = parts[0]
        for name in imported_modules(path):
            if owner in ("planner", "sandbox") and (name == "torch.cuda" or name.startswith("torch.cuda.")):
                found.append(f"{path}: imports {name}")
            if owner == "sandbox" and (name == "torch" or name.startswith("torch.")):
                found.append(f"{path}: imports {name} (sandbox must not import torch)")
            if not name.startswith("openk3."):
                continue
            target = name.split(".")[1]
            if target in FORBIDDEN.get(owner, set()):
                if any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_EXCEPTIONS.get(owner, set())):
                    continue
                found.append(f"{path}: openk3.{owner} imports {name}")
    return found


def test_imports_point_one_way() -> None:
    assert violations() == []


def test_checker_catches_a_wrong_arrow(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "openk3" / "model"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("def f():\n    from openk3.serve import engine\n")
    sandbox = tmp_path / "openk3" / "sandbox"
    sandbox.mkdir()
    (sandbox / "y.py").write_text("import torch.cuda\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "openk3")
    found = violations()
    assert any("openk3.model imports openk3.serve" in v for v in found)
    assert any("torch.cuda" in v for v in found)


def test_planner_and_sandbox_import_without_torch() -> None:
    import subprocess

    code = "import sys, openk3.planner, openk3.sandbox, openk3.serve.cache.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"


def test_public_entry_points_resolve() -> None:
    from openk3 import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams.__name__ == "SamplingParams"
