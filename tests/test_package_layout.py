"""The package layout shows the architecture (issue 50, item 5; docs/reference/architecture.md, "Layout"): the
subpackages of flodl_exp import each other in one direction only, and each layer reaches only the layers below it.

Read from source (every import, lazy ones inside functions too, as tests/test_core_import_contract.py reads them);
top-level modules (config.py, events.py, ...) are shared leaves and not a layer of their own."""
from __future__ import annotations

import collections
from pathlib import Path

from test_core_import_contract import imports_of

PACKAGE = Path(__file__).resolve().parent.parent / "flodl_exp"

MAY_IMPORT = {
    "protocol": set(),
    "policy": set(),
    "core": {"policy", "protocol"},
    "simulate": {"core", "policy", "protocol"},
    "coordinator": {"core", "policy", "protocol", "simulate"},
    "rank": {"policy", "protocol"},
    "jobs": {"rank", "coordinator", "policy", "protocol", "simulate"},
}
"""Each layer's subpackages below it: the protocol and the policies at the bottom, the sans-I/O core on them,
the simulator and the coordinator's shell around the core, a rank beside them (it speaks the protocol only), the
jobs (launcher, tasks) on top."""


def _modules() -> list[str]:
    out = []
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir() and (PACKAGE / parts[1] / "__init__.py").exists():
        return parts[1]
    return None


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) subpackage -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for m in _modules():
        a = _subpackage(m)
        if a is None:
            continue
        for n in imports_of(m):
            b = _subpackage(n) if n.startswith("flodl_exp.") else None
            if b is not None and b != a:
                edges[(a, b)].append(f"{m} imports {n}")
    return edges


def test_no_two_subpackages_import_each_other_directly_or_around_a_cycle() -> None:
    edges = package_edges()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(f"{a} -> {b}: {edges[(a, b)][0]}" for a, b in edges if a in reach(b))
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = sorted(f"{a} -> {b}: {why[0]}" for (a, b), why in package_edges().items()
                   if a in MAY_IMPORT and b not in MAY_IMPORT[a])
    assert not wrong, "imports against the layering (MAY_IMPORT):\n" + "\n".join(wrong)
    assert set(MAY_IMPORT) <= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_the_reader_sees_a_layering_violation() -> None:
    assert any(a == "coordinator" and b == "core" for a, b in package_edges()), "the coordinator drives the core"
