"""Dependencies point one way (docs: the layering): every import of every module, read with `ast` (imports inside
functions and under ``if TYPE_CHECKING`` included), goes from a package to itself, to the root package or to a
package below it, and no two modules import each other, directly or around a loop.

    prefixroute (root: common/)  <-  model_servers
                                 <-  telemetry
                                 <-  extproc (may import telemetry)
                                 <-  dashboard (may import telemetry)
                                 <-  bench (extproc, model_servers, telemetry)
                                 <-  stack (anything)

`prefixroute.cli` (common/cli.py), the command dispatcher, imports each command's module by name when it runs and
is exempt. A package is found from pyproject's package-dir, so a new folder is checked as soon as it is declared
(test_core_layout.py checks that it is)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ROOT_PACKAGE = "prefixroute"

MAY_IMPORT: dict[str, frozenset[str]] = {
    ROOT_PACKAGE: frozenset(),
    "model_servers": frozenset(),
    "telemetry": frozenset(),
    "extproc": frozenset({"telemetry"}),
    "dashboard": frozenset({"telemetry"}),
    "bench": frozenset({"extproc", "model_servers", "telemetry"}),
    "stack": frozenset({"extproc", "model_servers", "telemetry", "dashboard", "bench"}),
}
"""Per package (the first name under prefixroute; the root package as "prefixroute"): the packages besides itself
and the root package that its modules may import."""

EXEMPT = frozenset({"prefixroute.cli"})

KNOWN_CYCLES: list[frozenset[str]] = []
"""Import cycles tolerated for now, each exactly as found (a larger cycle through them fails)."""


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Import name -> source folder of each top-level mapping in pyproject's package-dir."""
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    return {name: pyproject.parent / folder for name, folder in setuptools["package-dir"].items()}


def find_modules(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the mapped folders (a folder mapped separately is skipped
    under its parent: common/ holds no other package's files, but a nested mapping would)."""
    out: dict[str, Path] = {}
    mapped = {d.resolve() for d in dirs.values()}
    for name, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            if any(p.resolve() in mapped and p.resolve() != folder.resolve() for p in path.parents):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def imports_of(module: str, path: Path, modules: Iterable[str]) -> list[tuple[str, int]]:
    """(imported module, line) for each import of our modules in `path`: ``from a.b import c`` names the module
    ``a.b.c`` when there is one, else ``a.b``; relative imports are resolved against `module`."""
    known = set(modules)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    out.append((sub, node.lineno))
                elif base in known:
                    out.append((base, node.lineno))
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else ROOT_PACKAGE


def graph(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, self-imports left out."""
    out: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(name, path, modules):
            if target != name:
                edges.setdefault(target, line)
        out[name] = edges
    return out


def upward_imports(edges: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path]) -> list[str]:
    """Each import from a package to one it may not import, as "file:line: a imports b (X may not import Y)"."""
    bad = []
    for src, targets in sorted(edges.items()):
        if src in EXEMPT:
            continue
        a = package_of(src)
        for dst, line in sorted(targets.items()):
            b = package_of(dst)
            if b != a and b != ROOT_PACKAGE and b not in MAY_IMPORT[a]:
                bad.append(f"{modules[src].relative_to(ROOT) if modules[src].is_relative_to(ROOT) else modules[src]}"
                           f":{line}: {src} imports {dst} ({a} may not import {b})")
    return bad


def cycles(edges: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    modules = find_modules(package_dirs(ROOT / "pyproject.toml"))
    return modules, graph(modules)


def test_every_package_has_a_layer(tree) -> None:  # noqa: ANN001
    modules, _ = tree
    declared = {name.split(".")[1] for name in package_dirs(ROOT / "pyproject.toml") if name != ROOT_PACKAGE}
    assert declared == set(MAY_IMPORT) - {ROOT_PACKAGE}, "a package without a layer in MAY_IMPORT (or a stale one)"
    assert len(modules) > 100  # the scan found the code (not an empty folder mapping)


def test_no_import_points_up(tree) -> None:  # noqa: ANN001
    modules, edges = tree
    assert upward_imports(edges, modules) == []


def test_no_module_import_cycle(tree) -> None:  # noqa: ANN001
    _, edges = tree
    found = cycles(edges)
    assert [sorted(c) for c in found if c not in KNOWN_CYCLES] == []


def test_the_known_cycles_still_exist(tree) -> None:  # noqa: ANN001
    # A known cycle that was broken must leave KNOWN_CYCLES, so it cannot come back unnoticed.
    _, edges = tree
    found = cycles(edges)
    assert [sorted(c) for c in KNOWN_CYCLES if c not in found] == []


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    # The checker itself, on a tree made for it: a root module importing a package above it, a model_servers
    # module importing extproc (under TYPE_CHECKING, in a function and relatively), and a three-module loop.
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "prefixroute" = "common", "prefixroute.extproc" = "extproc", '
        '"prefixroute.model_servers" = "model_servers" }\n')
    files = {
        "common/__init__.py": "",
        "common/types.py": "from prefixroute.extproc import a\n",
        "extproc/__init__.py": "",
        "extproc/a.py": "from prefixroute.extproc.b import x\n",
        "extproc/b.py": "import prefixroute.extproc.c\n",
        "extproc/c.py": "from . import a\n",
        "model_servers/__init__.py": "",
        "model_servers/m.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefixroute.extproc.a "
                               "import A\ndef f():\n    from ..extproc import b\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = find_modules(package_dirs(tmp_path / "pyproject.toml"))
    edges = graph(modules)
    bad = upward_imports(edges, modules)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "prefixroute.model_servers.m imports prefixroute.extproc.a (model_servers may not import extproc)",
        "prefixroute.model_servers.m imports prefixroute.extproc.b (model_servers may not import extproc)",
        "prefixroute.types imports prefixroute.extproc.a (prefixroute may not import extproc)",
    ]
    assert bad[0].startswith(f"{tmp_path / 'model_servers' / 'm.py'}:3:")
    assert cycles(edges) == [frozenset({"prefixroute.extproc.a", "prefixroute.extproc.b", "prefixroute.extproc.c"})]
