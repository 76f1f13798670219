"""The import rule (docs/architecture.md "Layers"), read from the source with `ast`, no module imported.

    core library    cortex/
    processes       extproc/  ingest/  observe/          peers: they meet through the core, never by import
    applications    cortexsim/ <- cortexbench/ <- cortexctl/

A module may import its own top-level package and the packages of lower layers, nothing else; and no circle runs
through any modules, package `__init__`s included. Every import counts: module-level, inside functions, and under
`if TYPE_CHECKING:` (a type is a dependency too). `from pkg import sub` depends on `pkg`'s `__init__` as well as
on `pkg.sub`: the statement reads the package's namespace.
"""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cortex",),
    ("extproc", "ingest", "observe"),
    ("cortexsim",),
    ("cortexbench",),
    ("cortexctl",),
)
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages, and every Cython one
    (.pyx: compiled at install, imported like any module)."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted([*(root / pkg).rglob("*.py"), *(root / pkg).rglob("*.pyx")]):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, mods: Mapping[str, Path]) -> str | None:
    """The project module an imported name lives in (`a.b.C` -> `a.b`), or None for anything outside."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(name: str, path: Path, mods: Mapping[str, Path]) -> dict[str, int]:
    """Project modules `name` imports, each with the line of its first import."""
    is_init = path.name == "__init__.py"
    package = name if is_init else name.rpartition(".")[0]
    out: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != name:
            out.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_owner(alias.name, mods), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            add(_owner(source, mods), node.lineno)
            for alias in node.names:
                if f"{source}.{alias.name}" in mods:
                    add(f"{source}.{alias.name}", node.lineno)
    return out


def graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, int]]:
    mods = modules(root, packages)
    return {name: (imports if path.suffix == ".py" else cython_imports)(name, path, mods)
            for name, path in mods.items()}


_CYTHON_IMPORT = re.compile(r"^\s*(?:from|import|cimport)\s+([\w.]+)", re.MULTILINE)


def cython_imports(name: str, path: Path, mods: Mapping[str, Path]) -> dict[str, int]:
    """A Cython module's project imports, by the statements' leading names (its syntax is not Python's)."""
    text = path.read_text()
    out: dict[str, int] = {}
    for m in _CYTHON_IMPORT.finditer(text):
        target = _owner(m.group(1), mods)
        if target is not None and target != name:
            out.setdefault(target, text.count("\n", 0, m.start()) + 1)
    return out


def upward(edges: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Each import of a module in a layer above the importer's, or of a peer package in the same layer."""
    bad = []
    for src, targets in sorted(edges.items()):
        mine = src.split(".")[0]
        for dst, line in sorted(targets.items()):
            theirs = dst.split(".")[0]
            if theirs != mine and RANK[theirs] >= RANK[mine]:
                bad.append(f"{src}:{line} imports {dst} ({theirs} is not below {mine})")
    return bad


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a path that returns to its start
    (Tarjan's algorithm, iterative, then a shortest path back inside the component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.add(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    components.append(comp)
    found = []
    for comp in components:
        first = min(comp)
        # Breadth-first from `first` back to itself, inside the component: the shortest circle through it.
        came: dict[str, str] = {}
        frontier = [first]
        while frontier and first not in came:
            following = []
            for node in frontier:
                for nxt in sorted(edges.get(node, ())):
                    if nxt in comp and nxt not in came:
                        came[nxt] = node
                        following.append(nxt)
            frontier = following
        path = [first]
        while (prev := came[path[-1]]) != first:
            path.append(prev)
        found.append([first, *reversed(path[1:]), first])
    return found


@pytest.fixture(scope="module")
def edges() -> dict[str, dict[str, int]]:
    return graph(ROOT, RANK)


def test_every_installed_package_has_a_layer() -> None:
    """A new top-level package is placed in a layer before it ships (pyproject's package list is the source)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} == set(RANK)


def test_no_module_imports_a_layer_above_it(edges: dict[str, dict[str, int]]) -> None:
    assert len(edges) > 100  # the whole product was read, not an empty directory
    bad = upward(edges)
    assert not bad, "imports against docs/architecture.md \"Layers\":\n  " + "\n  ".join(bad)


def test_no_import_circle(edges: dict[str, dict[str, int]]) -> None:
    found = cycles(edges)
    assert not found, "import circles:\n  " + "\n  ".join(
        " -> ".join(f"{a} (line {edges[a][b]})" for a, b in itertools.pairwise(c)) + f" -> {c[-1]}"
        for c in found)


def test_the_checker_sees_what_it_should(tmp_path: Path) -> None:
    """The rule's reader on a made-up tree: function-level, TYPE_CHECKING, relative and package-init imports
    all count, and a circle is reported as its path."""
    files = {
        "cortex/__init__.py": "",
        "cortex/a.py": "def f():\n    from cortex import b\n",
        "cortex/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n",
        "cortex/c.py": "import cortex.a\n",
        "cortex/pkg/__init__.py": "from cortex.pkg.leaf import Y\n",
        "cortex/pkg/leaf.py": "from cortex.pkg import other\n",
        "cortex/pkg/other.py": "",
        "extproc/__init__.py": "",
        "extproc/x.py": "import json\nfrom cortex.a import f\n",
        "ingest/__init__.py": "",
        "ingest/y.py": "from extproc import x\n",
        "observe/__init__.py": "",
        "cortexsim/__init__.py": "",
        "cortexbench/__init__.py": "",
        "cortexctl/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "cortex" / "d.py").write_text("import cortexctl\n")
    g = graph(tmp_path, RANK)
    assert g["extproc.x"] == {"cortex.a": 2}  # json is not the project's
    assert upward(g) == ["cortex.d:1 imports cortexctl (cortexctl is not below cortex)",
                         "ingest.y:1 imports extproc (extproc is not below ingest)",
                         "ingest.y:1 imports extproc.x (extproc is not below ingest)"]
    assert sorted(cycles(g)) == [["cortex.a", "cortex.b", "cortex.c", "cortex.a"],
                                 ["cortex.pkg", "cortex.pkg.leaf", "cortex.pkg"]]
