"""The package's layers (docs/architecture.md, "Layers"): every import of a module of
``shared/`` or ``services/`` points down the layers or stays inside its own package, and no
modules import each other, directly or through a chain. Imports are read with ``ast`` from
the source, module-level and inside functions alike (a function-level import is a
dependency all the same, only a later one), so the check needs nothing importable."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("shared", "services")

LAYERS = (
    "shared.launch.cli",
    "shared.launch.artefacts",
    "shared.launch.lab",
    "shared.launch",
    "services",
    "shared.config",
    "shared.algos",
    "shared.agents",
    "shared.replay",
    "shared.envs",
    "shared.transport",
    "shared.data",
    "shared.runtime",
)
"""Top to bottom: a module may import from its own layer's package or from layers below it. A
module belongs to the first entry it is or lies under: ``shared.launch``'s own modules (run
control) sit below its ``lab`` and ``artefacts``, and ``cli`` above all."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module, e.g. ``shared.launch.cli``."""
    target: str
    """The module imported: ``from pkg import submodule`` names the submodule."""
    path: str
    """The importing file, relative to the repository."""
    line: int


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Module name -> file of every module under ROOTS (a package is its ``__init__.py``)."""
    found = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(repo: Path = REPO) -> list[Import]:
    """Every import of a project module by a project module (standard library and third-party
    imports are not the layers' business)."""
    known = modules(repo)
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = str(path.relative_to(repo))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                target = _nearest_module(target, known)
                if target is not None and target != name:
                    found.append(Import(name, target, rel, node.lineno))
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest_module(target: str, known: dict[str, Path]) -> str | None:
    """``target`` or the closest package above it that is a project module (``import
    shared.config.schema.Experiment`` cannot be, but ``shared.x.y`` of a missing y is x)."""
    parts = target.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def layer(module: str) -> int | None:
    """Index in LAYERS (0 = top) of the layer ``module`` belongs to, None if none."""
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def upward_imports(found: list[Import]) -> list[str]:
    """One message per import that points up the layers (or out of every layer)."""
    problems = []
    for imp in found:
        src, dst = layer(imp.source), layer(imp.target)
        if src is None:
            if imp.source not in ("shared", "services"):
                problems.append(f"{imp.path}:{imp.line}: {imp.source} is in no layer; add its package to "
                                f"tests/test_layers.py LAYERS and docs/architecture.md")
            continue
        if dst is None:
            problems.append(f"{imp.path}:{imp.line}: imports {imp.target}, which is in no layer")
        elif dst < src:
            problems.append(f"{imp.path}:{imp.line}: {imp.source} (layer {LAYERS[src]}) imports {imp.target} "
                            f"(layer {LAYERS[dst]}, above it): imports may only point down the layers")
    return problems


def cycles(found: list[Import]) -> list[list[Import]]:
    """One cycle (its imports, in order) per strongly connected group of modules that import
    each other, directly or through a chain."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in found:
        graph.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(group), graph) for group in groups]


def _cycle_in(group: list[str], graph: dict[str, dict[str, Import]]) -> list[Import]:
    """A shortest cycle through the group's first module (breadth-first inside the group)."""
    members, start = set(group), group[0]
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, imp in sorted(graph.get(v, {}).items()):
                if w == start:
                    path = [imp]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if w in members and w not in came_from:
                    came_from[w] = imp
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {group}")


def describe(cycle: list[Import]) -> str:
    return "import cycle: " + " -> ".join(f"{imp.source} ({imp.path}:{imp.line})" for imp in cycle) \
        + f" -> {cycle[0].source}"


def test_every_package_is_in_a_layer():
    packages = {m for m in modules() if m.count(".") == 1 and m.startswith("shared.")}
    missing = sorted(p for p in packages if layer(p) is None)
    if missing:
        pytest.fail(f"packages in no layer: {', '.join(missing)}; add them to LAYERS here and to "
                    "docs/architecture.md, Layers", pytrace=False)


def test_imports_point_down_the_layers():
    problems = upward_imports(imports())
    if problems:
        pytest.fail("rule: an import points down the layers or stays in its package "
                    "(docs/architecture.md, Layers); broken by:\n" + "\n".join(problems), pytrace=False)


def test_no_modules_import_each_other():
    found = cycles(imports())
    if found:
        pytest.fail("rule: no modules import each other, directly or through a chain, also inside functions "
                    "(docs/architecture.md, Layers); broken by:\n" + "\n".join(describe(c) for c in found),
                    pytrace=False)


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    """The rules on a small tree: config importing launch is upward; two launch modules
    importing each other (one inside a function, one as ``from pkg import module``) is a
    cycle; a relative import resolves like an absolute one."""
    files = {
        "shared/__init__.py": "",
        "shared/launch/__init__.py": "",
        "shared/launch/a.py": "def f():\n    from shared.launch import b\n",
        "shared/launch/b.py": "from . import a\nfrom shared.config import X\n",
        "shared/config/__init__.py": "",
        "shared/config/schema.py": "import os\n\n\ndef g():\n    import shared.launch.a\n",
        "services/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = imports(tmp_path)
    assert upward_imports(found) == [
        "shared/config/schema.py:5: shared.config.schema (layer shared.config) imports shared.launch.a "
        "(layer shared.launch, above it): imports may only point down the layers"]
    assert [describe(c) for c in cycles(found)] == [
        "import cycle: shared.launch.a (shared/launch/a.py:2) -> shared.launch.b (shared/launch/b.py:1) "
        "-> shared.launch.a"]
