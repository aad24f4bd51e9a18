"""The package's shape, measured: modules per folder, import cycles between files and
between sibling folders (imports inside functions count), long functions, and code that
assigns to attributes of torch or torch.nn.functional.  tests/test_layout.py holds the
project to the limits; ``python -m server.testing.layout`` prints what it finds.

Why: a folder of twenty modules hides which is a kernel, a layout or the model, and a
module-level patch of ``F.linear`` reached every library in the process.  The rules are
cheap to check and easy to lose in a refactor, so they are checked.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "server"
MAX_MODULES = 12
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Module:
    name: str            # server.model.layers.moe
    path: Path
    tree: ast.Module

    @property
    def package(self) -> str:
        """The folder (package) this file sits in: its own name for an __init__.py."""
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Module]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = Module(name, path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return out


def imports(module: Module, known: dict[str, Module]) -> set[str]:
    """Project modules ``module`` imports anywhere in its body (functions included)."""
    out = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.package.split(".")
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module.name:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def file_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Import cycles between files.  A package's __init__ re-exporting its own modules is
    not a cycle of the code: edges from a package's __init__ into its own folder are left
    out (an import of ``pkg.x`` runs ``pkg/__init__`` first, which is the same in any order)."""
    graph = {}
    for name, m in mods.items():
        own = m.path.name == "__init__.py"
        graph[name] = {t for t in imports(m, mods) if not (own and t.startswith(name + "."))}
    return _cycles(graph)


def folder_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Import cycles between sibling folders: for each package, its direct sub-packages
    (and its own files, each standing alone) as nodes, an edge where a file under one
    imports a file under another."""
    found = []
    packages = {m.package for m in mods.values()}
    for parent in sorted(packages):
        def node(name: str) -> str | None:
            if not name.startswith(parent + "."):
                return None
            head = name[len(parent) + 1:].split(".", 1)[0]
            return f"{parent}.{head}"
        graph: dict[str, set[str]] = defaultdict(set)
        for name, m in mods.items():
            src = node(name)
            if src is None:
                continue
            for target in imports(m, mods):
                dst = node(target)
                if dst is not None and dst != src:
                    graph[src].add(dst)
        found += [c for c in _cycles(graph) if any(f"{c_}" in packages for c_ in c)]
    return found


def crowded_folders(mods: dict[str, Module]) -> dict[str, int]:
    """Folders holding more than MAX_MODULES modules flat (__init__ not counted)."""
    count: dict[str, int] = defaultdict(int)
    for m in mods.values():
        if m.path.name != "__init__.py":
            count[m.package] += 1
    return {k: v for k, v in count.items() if v > MAX_MODULES}


def long_functions(mods: dict[str, Module]) -> list[tuple[str, int]]:
    out = []
    for m in mods.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((f"{m.path.relative_to(ROOT)}:{node.lineno} {node.name}", n))
    return out


def torch_patches(paths: list[Path]) -> Iterator[str]:
    """Assignments to an attribute of torch or torch.nn.functional (``F.linear = ...``,
    ``setattr(torch, ...)``, ``monkeypatch.setattr(F, ...)``) in ``paths``."""
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases = {"torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name.startswith("torch")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                aliases |= {a.asname or a.name for a in node.names}

        def rooted(expr: ast.expr) -> bool:
            """Whether ``expr`` names torch or a part of it: an alias (``torch``, ``F``), or
            another module's ``F`` / ``torch`` / ``functional`` (``prediction.F``).  A
            ``config`` module of torch's is made to be set, through its ``patch``."""
            parts = []
            while isinstance(expr, ast.Attribute):
                parts.append(expr.attr)
                expr = expr.value
            if any("config" in p for p in parts):
                return False
            return (isinstance(expr, ast.Name) and expr.id in aliases) or \
                bool(parts and parts[0] in ("F", "torch", "functional"))

        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and rooted(sub.value):
                        yield f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.Call) and node.args and (
                    (isinstance(node.func, ast.Name) and node.func.id == "setattr")
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "setattr")):
                if rooted(node.args[0]):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}"


def project_sources(root: Path = ROOT) -> list[Path]:
    return [p for folder in ("server", "tests", "benchmarks", "training", "scripts")
            for p in sorted((root / folder).rglob("*.py"))]


def report() -> dict[str, object]:
    mods = modules()
    return {"crowded folders": crowded_folders(mods), "file cycles": file_cycles(mods),
            "folder cycles": folder_cycles(mods), "long functions": long_functions(mods),
            "torch patches": list(torch_patches(project_sources()))}


if __name__ == "__main__":
    for key, value in report().items():
        print(f"{key}: {value}")
