"""Arrows point down: the import graph of shardwise has no circles and no reach-ins.

Pure: every module under ``src/shardwise`` is parsed with ``ast``, nothing is imported (except
for the public-names check at the end). The layering docs/architecture.md describes
(comm's timeout below the mesh, the mesh below the rest of comm, comm below tensor and dispatch,
debug and the trainer on top) holds only as long as
nothing imports upwards; a function-level import that dodges a circle at import time is still
an arrow pointing up, so imports inside functions count too. Imports under
``if TYPE_CHECKING:`` never run and are left out of the graph.

Reach-ins: a module may use another package's private names (``_x``) only inside its own
top-level package (``shardwise.comm.*`` may share privates with each other, ``shardwise.debug``
may not read ``comm._issue``); across packages it goes through public functions and hooks.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "shardwise"
# The one circle allowed, if kept (it is not, today: dispatch gets the DTensor class bound at import).
ALLOWED_CYCLE: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    """One arrow: ``source`` imports ``target`` at ``file:line``."""

    source: str
    target: str
    file: str
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


MODULES = _modules()


def _package_of(module: str) -> str:
    """The top-level package of shardwise a module belongs to (``comm`` for ``shardwise.comm.issue``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def _where(module: str, node: ast.AST) -> str:
    return f"{MODULES[module].relative_to(SRC.parent)}:{node.lineno}"  # type: ignore[attr-defined]


def imports_of(module: str) -> list[Import]:
    """Every shardwise module ``module`` imports, wherever the import statement sits."""
    tree = _parse(module)
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            if target in MODULES and target != module:
                found.append(Import(module, target, str(MODULES[module].relative_to(SRC.parent)), node.lineno))
    return list(dict.fromkeys(found))  # one arrow per statement


def import_graph() -> dict[str, list[Import]]:
    return {module: imports_of(module) for module in MODULES}


def strongly_connected(graph: dict[str, list[Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the import graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted({i.target for i in graph[start]})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted({i.target for i in graph[child]}))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def shortest_cycle(component: set[str], graph: dict[str, list[Import]]) -> list[Import]:
    """One shortest circle through the component's first module (breadth-first), as its arrows."""
    start = min(component)
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for arrow in graph[module]:
                if arrow.target == start:
                    path = [arrow]
                    while path[0].source != start:
                        path.insert(0, came_by[path[0].source])
                    return path
                if arrow.target in component and arrow.target not in came_by:
                    came_by[arrow.target] = arrow
                    following.append(arrow.target)
        frontier = following
    return []


def describe_cycle(component: set[str], graph: dict[str, list[Import]]) -> str:
    """A shortest circle, then every arrow inside the component, each with the line that makes it."""
    circle = " -> ".join([min(component)] + [f"{i.target} ({i.file}:{i.line})" for i in shortest_cycle(component, graph)])
    arrows = [i for m in sorted(component) for i in graph[m] if i.target in component]
    return f"  e.g. {circle}\n" + "\n".join(f"  {i.source} -> {i.target}  ({i.file}:{i.line})" for i in arrows)


def test_no_import_cycles():
    graph = import_graph()
    cycles = [c for c in strongly_connected(graph) if len(c) > 1 and c != ALLOWED_CYCLE]
    message = "\n\n".join(f"import circle among {sorted(c)}:\n{describe_cycle(c, graph)}" for c in cycles)
    assert not cycles, message


def _module_aliases(tree: ast.Module, module: str) -> dict[str, str]:
    """Local names bound to a shardwise module: ``from shardwise import comm``, ``import shardwise.x as y``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == ROOT:
                    aliases[a.asname or ROOT] = a.name if a.asname else ROOT
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
    return aliases


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _owner(chain: list[str], aliases: dict[str, str]) -> str | None:
    """The shardwise module ``chain`` (a dotted expression) evaluates to, or None."""
    if chain[0] not in aliases:
        return None
    module = aliases[chain[0]]
    for part in chain[1:]:
        module = f"{module}.{part}"
        if module not in MODULES:
            return None
    return module


def reach_ins(module: str) -> list[str]:
    """``file:line: name`` for each private name of another top-level package that ``module`` uses."""
    tree = _parse(module)
    aliases = _module_aliases(tree, module)
    mine = _package_of(module)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if base.split(".")[0] != ROOT or _package_of(base) == mine:
                continue
            found += [f"{_where(module, node)}: from {base} import {a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _dotted(node.value)
            owner = _owner(chain, aliases) if chain else None
            if owner is not None and _package_of(owner) != mine:
                found.append(f"{_where(module, node)}: {owner}.{node.attr}")
    return found


def test_no_reach_ins_across_packages():
    found = [line for module in MODULES for line in reach_ins(module)]
    assert not found, "private names used outside their package:\n" + "\n".join(found)


def test_debug_tools_import_no_parallelism():
    """The debug tools read what parallelisms record through public hooks (``comm``'s recorders,
    ``comm.per_peer_bytes``); they import none of ``shardwise.parallel``."""
    found = [f"{i.file}:{i.line}: {i.target}" for module in MODULES if _package_of(module) == "debug"
             for i in imports_of(module) if _package_of(i.target) == "parallel"]
    assert not found, "shardwise.debug imports shardwise.parallel:\n" + "\n".join(found)


PUBLIC_MODULES = ["shardwise", "shardwise.parallel", "shardwise.debug", "shardwise.experimental",
                  "shardwise.fsdp", "shardwise.device_mesh", "shardwise.placement_types"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_names_import(name):
    module = importlib.import_module(name)
    assert module.__all__, f"{name} has an empty __all__"
    missing = [n for n in module.__all__ if n not in vars(module)]  # not the missing-name hook's answer
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


# ---------------------------------------------------------------------- the checker checks
def test_checker_finds_a_cycle_and_a_reach_in(tmp_path):
    """The analysis itself can fail: a two-module circle and a reach-in written on purpose."""
    pkg = tmp_path / "src" / ROOT
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from shardwise.b import y\n    return y._hidden\n")
    (pkg / "b" / "y.py").write_text("from shardwise.a.x import f\n_hidden = 1\n")
    global SRC, MODULES
    saved = SRC, MODULES
    SRC = tmp_path / "src"
    MODULES = _modules()
    try:
        graph = import_graph()
        cycles = [c for c in strongly_connected(graph) if len(c) > 1]
        assert cycles == [{"shardwise.a.x", "shardwise.b.y"}]
        described = describe_cycle(cycles[0], graph)
        assert "e.g. shardwise.a.x -> shardwise.b.y (src/shardwise/a/x.py:2) -> shardwise.a.x (src/shardwise/b/y.py:1)" in described
        assert "shardwise.a.x -> shardwise.b.y  (src/shardwise/a/x.py:2)" in described
        assert reach_ins("shardwise.a.x") == ["src/shardwise/a/x.py:3: shardwise.b.y._hidden"]
    finally:
        SRC, MODULES = saved
