"""No import circles in flodl_exp/: every module is parsed (``ast``, nothing imported) and the test fails
naming the circle, edge by edge, with the line of each import.

What counts as an edge ``a -> b``: every import of a flodl_exp module ``b`` written in ``a``:
* at module level (including under ``try``/``if`` at module level);
* under ``if TYPE_CHECKING:``: it never runs, but ``a``'s annotations still name ``b``; a circle kept
  only for annotations is broken with a small Protocol on the reading side (see coordinator/records.py);
* inside a function (a lazy import): it cannot fail at import time, but two modules that need each
  other are one module in two files all the same; lazy imports exist here to keep torch and MLflow
  off the CLI's import, not to hide a circle.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. A submodule's
implicit import of its parent packages is not an edge (every submodule would close a circle with an
``__init__`` that imports it, which Python handles by design).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flodl_exp"


class Edge(NamedTuple):
    target: str
    kind: str  # "module", "type_checking" or "local"
    line: int


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, known: set[str]) -> list[Edge]:
    """Every import of a module in ``known`` that ``module`` (at ``path``) writes, with its kind."""
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and kind == "module" and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, "type_checking")
                for stmt in child.orelse:
                    visit_one(stmt, kind)
            else:
                visit_one(child, kind)

    def visit_one(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            edges.extend(Edge(a.name, kind, node.lineno) for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, module, is_package)
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                if target in known:
                    edges.append(Edge(target, kind, node.lineno))
        inner = "local" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
        visit(node, inner)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "module")
    return edges


def import_graph() -> dict[str, dict[str, Edge]]:
    """module -> {imported module -> its first import} over flodl_exp/ (self-imports left out)."""
    mods = _modules()
    graph: dict[str, dict[str, Edge]] = {}
    for m, path in mods.items():
        graph[m] = {}
        for e in imports_of(m, path, set(mods)):
            if e.target != m:
                graph[m].setdefault(e.target, e)
    return graph


def circles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a closed path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def strong(v: str) -> None:  # Tarjan; the package is far too small for the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_path_in(graph, comp) for comp in comps]


def _path_in(graph: dict[str, dict[str, Edge]], comp: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth first, inside the component)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in comp:
                    continue
                if w == start:
                    back = [v]  # v, its predecessor, ..., start
                    while back[-1] != start:
                        back.append(prev[back[-1]])
                    return [*reversed(back), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in the component {sorted(comp)}")


def describe(graph: dict[str, dict[str, Edge]], circle: list[str]) -> str:
    steps = [f"{a} -> {b} ({graph[a][b].kind} import, {a.replace('.', '/')}.py line {graph[a][b].line})"
             for a, b in zip(circle, circle[1:])]
    return "import circle: " + "; ".join(steps)


def test_no_import_circles_in_flodl_exp():
    graph = import_graph()
    found = [describe(graph, c) for c in circles(graph)]
    assert not found, "\n".join(found)


def test_the_parser_sees_every_kind_of_import():
    """Guards the test above against passing on an empty graph."""
    graph = import_graph()
    assert len(graph) > 50
    assert graph["flodl_exp.coordinator.event_log"]["flodl_exp.coordinator.records"].kind == "module"
    assert graph["flodl_exp"]["flodl_exp.jobs.launcher"].kind == "type_checking"  # first seen under TYPE_CHECKING
    assert graph["flodl_exp.checkpoint"]["flodl_exp.config"].kind == "local"  # validate_resume's lazy import
    assert graph["flodl_exp.coordinator.records"]["flodl_exp.fsio"].kind == "module"  # from ..fsio import name


def test_a_circle_is_named_edge_by_edge():
    def e(t: str) -> Edge:
        return Edge(t, "module", 1)

    graph = {"p.a": {"p.b": e("p.b")}, "p.b": {"p.c": e("p.c")}, "p.c": {"p.a": e("p.a"), "p.d": e("p.d")}, "p.d": {}}
    assert circles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    assert describe(graph, ["p.a", "p.b", "p.c", "p.a"]).startswith("import circle: p.a -> p.b (module import, p/a.py line 1)")
    assert circles({"p.a": {"p.b": e("p.b")}, "p.b": {}}) == []
