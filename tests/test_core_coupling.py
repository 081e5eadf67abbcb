"""How much the core's components read of each other (issue 50, item 4), counted from the source and ratcheted.

A *cross-component read* is ``self.<collaborator>.<attribute>`` (or ``self._<collaborator>.<attribute>``) in a
module of ``flodl_exp/core`` or ``flodl_exp/policy`` where ``<collaborator>`` is another component the object
holds (the cycle, the cohort, the dispatcher, ...) and ``<attribute>`` is state: not a call, and not a reference to
one of the collaborator's methods or read-only properties (a query the owner answers: a bound method handed on
as a callback, a property computed from its state) and never a field of any class there.
Such a read ties the reader to the owner's fields; a query method (or a value passed in) leaves the owner free to
keep its state as it likes. The count only goes down: lower :data:`CEILING` with each step that removes reads.

``python tests/test_core_coupling.py`` prints the count per module and the most-read attributes.
"""
from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flodl_exp/core", "flodl_exp/policy")

COMPONENTS = {
    "boundaries": "EpochBoundaries", "callback_slack": "CallbackSlack", "checkpoint_fn": "CheckpointFnRole",
    "checkpoints": "Checkpoints", "cohort": "Cohort", "core": "ControlCore", "cycle": "AveragingCycle",
    "deaths": "Deaths", "dispatch": "Dispatcher", "elche": "ElChe", "faults": "FaultHandler",
    "guard": "ConvergenceGuard", "intents": "Intents", "life": "Lifecycle", "meta": "LrEventMeta", "obs": "CoreObserver",
    "pace": "ReportPacing", "pacing": "ReportPacing", "plan": "EpochPlan", "preemption": "Preemption",
    "reduces": "Reduces", "reports": "RankReports", "run_end": "RunEnd", "slack": "CallbackSlack",
    "startup": "StartupBlame", "store": "BundleStore", "writer": "BundleWriter",
}
"""The names the core's components are held under (with or without a leading underscore), and their classes.
(RunEnd's ``EvalState`` is not here: it is RunEnd's own record, which nothing else holds.)"""

CEILING = 0
"""The count on main; a change that adds reads fails here, one that removes them lowers it."""

ARGS_CEILING = 12
"""The most arguments a component's constructor takes on main (RunEnd: its settings, its ten peers and ports, the
run's actions); the issue's aim is about six. The shell's ports and the run's actions come as one value each
(core/seams.py); a constructor that grows past this wants its component split, not another argument."""


def _queries() -> dict[str, set[str]]:
    """Per class of the core and policy packages, the names it answers as queries: its methods and read-only
    properties, less any name it also assigns as a field (``self.<name> = ...``) or declares as one, and less
    any that returns a component (``AveragingCycle.elche``: the reader would reach past its collaborator)."""
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).glob("*.py"):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef):
                    continue
                queries: set[str] = set()
                fields: set[str] = set()
                for f in cls.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        returns = ast.unparse(f.returns) if f.returns is not None else ""
                        if any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in f.decorator_list):
                            fields.add(f.name)  # a writable property is a field
                        elif any(re.search(rf"\b{c}\b", returns) for c in COMPONENTS.values()):
                            fields.add(f.name)  # a query that hands out a component is as good as the field
                        else:
                            queries.add(f.name)
                    elif isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
                        fields.add(f.target.id)  # a dataclass (or Protocol) field
                for node in ast.walk(cls):
                    targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                               if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                    for t in targets:
                        for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                                fields.add(el.attr)
                out[cls.name] = out.get(cls.name, set()) | (queries - fields)
    return out


def is_read(node: ast.AST, called: set[int], queries: dict[str, set[str]], parents: dict[int, ast.AST]) -> bool:
    """``self.<collaborator>.<name>``, not called, where ``<name>`` is a field of the collaborator's class or
    another component (a query may not hand one out), or where what it answers is reached through (``self.<collaborator>.<name>.<more>``: the reader walks past the
    collaborator to a third object, even through a query)."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
            and node.value.attr.lstrip("_") in COMPONENTS and id(node) not in called):
        return False
    if node.attr not in queries.get(COMPONENTS[node.value.attr.lstrip("_")], set()):
        return True  # a field, or a query that hands out a component (``self._cycle.elche``): both are reads
    return isinstance(parents.get(id(node)), ast.Attribute)  # reached through


def cross_reads() -> list[tuple[str, int, str, str]]:
    """Every cross-component read: (module, line, collaborator, attribute)."""
    queries = _queries()
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            tree = ast.parse(path.read_text())
            called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
            parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
            for node in ast.walk(tree):
                if is_read(node, called, queries, parents):
                    assert isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    found.append((f"{pkg}/{path.name}", node.lineno, node.value.attr.lstrip("_"), node.attr))
    return found


def test_cross_component_reads_do_not_grow() -> None:
    reads = cross_reads()
    assert len(reads) <= CEILING, (
        f"{len(reads)} cross-component reads in the core (ceiling {CEILING}): add a query method on the owner, or pass "
        f"the value in, instead of reading its field; `python tests/test_core_coupling.py` lists them")


def constructor_args() -> dict[str, list[str]]:
    """Per component of the core (not ControlCore: the shell builds it), its constructor's arguments."""
    out: dict[str, list[str]] = {}
    wanted = set(COMPONENTS.values()) - {"ControlCore"}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text())):
                if isinstance(cls, ast.ClassDef) and cls.name in wanted:
                    for f in cls.body:
                        if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                            out[cls.name] = [a.arg for a in f.args.args[1:] + f.args.kwonlyargs]
    return out


def test_constructors_stay_narrow() -> None:
    args = constructor_args()
    assert "RunEnd" in args and "AveragingCycle" in args
    wide = {c: len(a) for c, a in args.items() if len(a) > ARGS_CEILING}
    assert not wide, (f"constructors over {ARGS_CEILING} arguments: {wide}; pass Ports/RunControl (core/seams.py) or a "
                      f"settings record, or split the component")
    loose = {c for c, a in args.items() if {"obs", "store"} <= set(a) or {"obs", "clock"} <= set(a)}
    assert not loose, f"{loose} take the shell's ports one by one: take a Ports (core/seams.py)"


def test_the_counter_finds_a_read_and_skips_calls_and_queries() -> None:
    src = ("class A:\n"
           "    def go(self):\n"
           "        x = self._cycle.world_size\n"       # a field: a read
           "        self._cycle.trigger([1])\n"         # a call
           "        f = self.reduces.try_finish\n"      # a method handed on
           "        p = self._life.phase\n"             # a read-only property: a query
           "        q = self._life.phase.value\n"       # ... reached through
           "        e = self._cycle.elche\n"            # a query handing out a component: a read
           "        return self.local.value\n")         # not a component
    tree = ast.parse(src)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    queries = _queries()
    assert "phase" in queries["Lifecycle"] and "world_size" not in queries["AveragingCycle"]
    assert "elche" not in queries["AveragingCycle"]
    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    hits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_read(n, called, queries, parents)]
    assert sorted(n.lineno for n in hits) == [3, 7, 8]
    missing = {c for c in COMPONENTS.values() if c not in queries and c not in ("CoreObserver", "BundleStore")}
    assert not missing, f"COMPONENTS names classes the core does not define: {missing}"


if __name__ == "__main__":
    reads = cross_reads()
    print(f"cross-component reads in {', '.join(PACKAGES)}: {len(reads)} (ceiling {CEILING})")
    for mod, n in collections.Counter(m for m, *_ in reads).most_common():
        print(f"{n:5d}  {mod}")
    print("constructor arguments (most first):")
    for cls, names in sorted(constructor_args().items(), key=lambda kv: -len(kv[1])):
        print(f"{len(names):5d}  {cls}({', '.join(names)})")
    print("most read:")
    for (c, a), n in collections.Counter((c, a) for *_, c, a in reads).most_common(25):
        print(f"{n:5d}  {c}.{a}")
