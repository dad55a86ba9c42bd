"""The worker's modules import each other without a cycle (deferred imports inside functions count too),
and no module reaches into another wing (a sub-package such as ``checkpoint/``) for a private name.

The graph is read from the source with ``ast``: an edge A -> B for every ``import B`` / ``from B import
x`` in A that names a worker module (``from pkg import mod`` is an edge to ``pkg.mod`` when ``mod`` is a
module). A package's ``__init__`` is not an implicit edge of its submodules: Python finishes a package's
``__init__`` before it loads a submodule, so only explicit imports can close a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker" / "rljob_worker"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = WORKER) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name: the nearest module
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_finder_sees_a_cycle_and_a_relative_import(tmp_path):
    pkg = tmp_path / "rljob_worker"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rljob_worker.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .c import X\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nX = 1\n")
    graph = import_graph(pkg)
    assert graph["rljob_worker.a"] == {"rljob_worker.sub.b"}
    assert graph["rljob_worker.sub.b"] == {"rljob_worker.sub.c"}
    assert find_cycle(graph) == ["rljob_worker.a", "rljob_worker.sub.b", "rljob_worker.sub.c", "rljob_worker.a"]
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_worker_has_no_import_cycle():
    graph = import_graph()
    assert "rljob_worker.megatron.engine" in graph and graph["rljob_worker.megatron.actor"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def wing(module: str) -> str:
    """The wing a worker module belongs to: its sub-package (``rljob_worker.checkpoint``), or the module
    itself for the few modules at the top of the worker."""
    parts = module.split(".")
    return ".".join(parts[:2])


def private_imports_across_wings(root: Path = WORKER) -> list[str]:
    """``importer: from target import _name`` for each private name taken from another wing's module."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    found = []
    for mod, path in sorted(files.items()):
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != root.name or wing(base) == wing(mod):
                continue
            found += [f"{mod}: from {base} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_finder_sees_a_private_name_taken_across_wings(tmp_path):
    pkg = tmp_path / "rljob_worker"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "inner.py").write_text("_secret = 1\npublic = 2\n")
    (pkg / "a" / "same_wing.py").write_text("from .inner import _secret\n")
    (pkg / "b" / "other.py").write_text("from rljob_worker.a.inner import public, _secret\n")
    (pkg / "top.py").write_text("from .a.inner import _secret\n")
    assert private_imports_across_wings(pkg) == [
        "rljob_worker.b.other: from rljob_worker.a.inner import _secret",
        "rljob_worker.top: from rljob_worker.a.inner import _secret",
    ]


def test_no_wing_imports_another_wings_private_name():
    assert private_imports_across_wings() == []


def test_the_worker_top_folder_holds_wings_and_few_modules():
    """The folder plan reads as the architecture: wings (packages) plus the run loop's few companions."""
    modules = sorted(p.name for p in WORKER.glob("*.py"))
    wings = sorted(p.name for p in WORKER.iterdir() if (p / "__init__.py").is_file())
    assert len(modules) <= 8, modules
    assert {"checkpoint", "trainers", "data", "runtime", "telemetry", "algorithms", "megatron", "rollout",
            "rewards"} <= set(wings)
