"""Dependencies point one way, and no module imports itself through others.

Layers, lowest first: config -> ops -> model -> serve -> parallel -> api (HTTP) -> scale (Ray Serve replicas) -> launch
(build_engine, the `openk3 serve` processes) -> llm (the offline entry) and its `openk3 generate`; train builds on model
(distillation drives engines through llm and rl);
planner and sandbox are leaves that never touch CUDA (the sandbox not even torch). Each package (or top-level module)
lists what it may import; anything else is a wrong arrow. The walk uses `ast`, so it also sees imports inside functions
and under TYPE_CHECKING, and `importlib.import_module("openk3...")` with a literal name: a lazy import, or one by name,
is still a dependency, and a cycle.
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
    # distillation drives engines: teachers score and the student samples through LLM, weight sync comes from rl
    "train": {"config", "ops", "model", "checks", "serve", "llm", "rl"},
    "api": {"config", "ops", "model", "serve", "parallel", "checks", "options"},  # HTTP only
    "scale": {"config", "serve", "parallel", "api", "checks", "options"},  # replicas on Ray Serve, built as launch says
    # build_engine (one way to build an engine) and the processes that serve it: above the server and its replicas
    "launch": {"config", "model", "serve", "parallel", "api", "scale", "checks", "options"},
    "llm": {"config", "model", "serve", "parallel", "options", "launch"},
    "llm_cli": {"serve", "llm", "launch"},  # `openk3 generate`
    # rollouts: drives an engine through LLM and runs tools in sandboxes (a client of both, so above them)
    "rl": {"config", "ops", "model", "serve", "parallel", "launch", "llm", "sandbox", "checks"},
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


def imported_by_name(node: ast.AST) -> str | None:
    """The module a call `import_module("openk3...")` (or `importlib.import_module(...)`) names with a literal string."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    first = node.args[0]
    if called == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("openk3."):
        return first.value
    return None


def imported_modules(path: Path) -> list[str]:
    """Every openk3-or-other module `path` names in an import, `from a import b` giving both `a` and `a.b`, and every
    openk3 module it imports by a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif (by_name := imported_by_name(node)) is not None:
            names.append(by_name)
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
            elif (by_name := imported_by_name(node)) in paths:
                targets.add(by_name)
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


def test_checker_sees_a_cycle_and_a_wrong_arrow_through_import_module(tmp_path: Path, monkeypatch) -> None:
    """The cycle issue 33 found (api/cli.py -> scale/cli.py -> scale/deploy.py -> api/cli.py) hid behind a name."""
    root = tmp_path / "openk3"
    for package in ("api", "scale"):
        (root / package).mkdir(parents=True)
    (root / "api" / "cli.py").write_text('import importlib\n\ndef scale():\n    return importlib.import_module("openk3.scale.cli")\n')
    (root / "scale" / "cli.py").write_text("from openk3.scale import deploy\n")
    (root / "scale" / "deploy.py").write_text("def parser():\n    from openk3.api import cli\n")
    (root / "scale" / "__init__.py").write_text("")
    (root / "api" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    assert "openk3.scale.cli" in imported_modules(root / "api" / "cli.py")
    assert any("openk3.api imports openk3.scale.cli" in v for v in violations())
    assert cycles(import_graph()) == [["openk3.api.cli", "openk3.scale.cli", "openk3.scale.deploy"]]


def test_planner_and_sandbox_import_without_torch() -> None:
    import subprocess

    code = "import sys, openk3.planner, openk3.sandbox, openk3.serve.cache.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"


def test_public_entry_points_resolve() -> None:
    from openk3 import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams.__name__ == "SamplingParams"
