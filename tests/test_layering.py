"""Dependencies point one way, and no module imports itself through others.

Layers, lowest first: config -> ops -> model -> serve -> parallel -> llm (the offline entry) -> api (HTTP and the CLI
commands); train builds on model; planner and sandbox are leaves that never touch CUDA (the sandbox not even torch).
Each package (or top-level module) lists what it may import; anything else is a wrong arrow. The walk uses `ast`, so it
also sees imports inside functions and under TYPE_CHECKING: a lazy import is still a dependency, and a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "openk3"

# owner (first path component under openk3/, a package or a top-level module) -> the openk3 owners it may import
ALLOWED = {
    "checks": set(),  # the shared validation helpers (standard library only)
    "options": {"checks"},  # settings dataclasses that build their own flags
    "config": {"checks"},
    "ops": {"config", "checks"},
    "model": {"config", "ops", "checks"},
    "serve": {"config", "ops", "model", "checks", "options"},
    "parallel": {"config", "ops", "model", "serve", "checks", "options"},
    "train": {"config", "ops", "model", "checks"},
    "launch": {"config", "model", "serve", "parallel", "checks", "options"},  # build_engine: one way to build an engine
    "llm": {"config", "model", "serve", "parallel", "options", "launch"},
    "api": {"config", "ops", "model", "serve", "parallel", "llm", "checks", "options", "launch"},
    "scale": {"config", "serve", "api", "checks", "options", "llm"},  # replicas on Ray Serve: builds on the server
    "planner": {"config", "checks"},
    "sandbox": {"checks"},
    "cli": set(),  # finds each package's `cli` module by name (importlib), so `openk3 plan` never loads torch
    "__init__": set(),  # resolves LLM and SamplingParams lazily by name, for the same reason
    "__main__": {"cli"},
}
# planner may import openk3.serve.cache.spec (byte sizes shared with the engine) and nothing else from serve
ALLOWED_MODULES = {"planner": {"openk3.serve.cache.spec", "openk3.serve.cache"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[str]:
    """Every openk3-or-other module `path` names in an import, `from a import b` giving both `a` and `a.b`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def owner_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        owner = owner_of(path)
        if owner not in ALLOWED:
            found.append(f"{path}: openk3.{owner} has no layering rule (add it to ALLOWED)")
            continue
        for name in imported_modules(path):
            if owner in ("planner", "sandbox") and (name == "torch.cuda" or name.startswith("torch.cuda.")):
                found.append(f"{path}: imports {name}")
            if owner == "sandbox" and (name == "torch" or name.startswith("torch.")):
                found.append(f"{path}: imports {name} (sandbox must not import torch)")
            if not name.startswith("openk3."):
                continue
            target = name.split(".")[1]
            if target == owner or target in ALLOWED[owner]:
                continue
            if any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_MODULES.get(owner, set())):
                continue
            found.append(f"{path}: openk3.{owner} imports {name}")
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the openk3 modules it imports: `import a.b` and `from a import b` depend on the module `a.b` when there is
    one, else (b is a name defined in a) on `a`."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.module in paths and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in paths else node.module)
        graph[module] = targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_one_way() -> None:
    assert violations() == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_checker_catches_a_wrong_arrow_and_a_cycle(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "openk3" / "model"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("def f():\n    from openk3.serve import engine\n")
    (bad / "a.py").write_text("from openk3.model.b import g\n")
    (bad / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from openk3.model.a import f\n")
    sandbox = tmp_path / "openk3" / "sandbox"
    sandbox.mkdir()
    (sandbox / "y.py").write_text("import torch.cuda\n")
    (tmp_path / "openk3" / "newpkg").mkdir()
    (tmp_path / "openk3" / "newpkg" / "z.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "openk3")
    found = violations()
    assert any("openk3.model imports openk3.serve" in v for v in found)
    assert any("torch.cuda" in v for v in found)
    assert any("openk3.newpkg has no layering rule" in v for v in found)
    assert cycles(import_graph()) == [["openk3.model.a", "openk3.model.b"]]


def test_planner_and_sandbox_import_without_torch() -> None:
    import subprocess

    code = "import sys, openk3.planner, openk3.sandbox, openk3.serve.cache.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"


def test_public_entry_points_resolve() -> None:
    from openk3 import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams.__name__ == "SamplingParams"
