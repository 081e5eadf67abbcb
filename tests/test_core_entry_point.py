"""One entry point (issue 50, item 2): a shell drives the control core only through ``handle(event)`` and reads it
only through ``core.view``; it names none of the core's components.

Read from source (``ast``): in each shell module below, an attribute of the core (``self.core.X``, ``engine.core.X``)
must be ``handle`` or ``view``, and no attribute anywhere may be one of the core's components (``.cycle``,
``.cohort``, ``.dispatch``, ...), so a component cannot be reached through an alias either: the simulator, the
coordinator and its process entry (``coordinator/main.py``).
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SHELLS = [*sorted((ROOT / "flodl_exp" / "simulate").glob("*.py")), ROOT / "flodl_exp" / "coordinator" / "coordinator.py",
          ROOT / "flodl_exp" / "coordinator" / "main.py"]
"""The modules held to the rule."""

ENTRY = {"handle", "view"}
COMPONENTS = {"cycle", "cohort", "dispatch", "life", "writer", "faults", "preemption", "checkpoints", "evals",
              "reduces", "boundaries", "run_end", "outbox", "intents", "slack", "pacing", "deaths", "reports",
              "checkpoint_fn"}
"""The core's components (its attributes that are objects with decisions of their own)."""


def _is_core(node: ast.expr) -> bool:
    """``self.core`` or ``<name>.core`` where the name is a variable (not a package path such as hydra.core)."""
    return (isinstance(node, ast.Attribute) and node.attr == "core" and isinstance(node.value, ast.Name)
            and node.value.id in {"self", "engine", "sim", "e", "co"})


def violations(path: Path) -> list[str]:
    """Each reach past ``handle`` and ``view`` in ``path``: ``<file>:<line>: <what>``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_core(node.value) and node.attr not in ENTRY:
            out.append(f"{path.name}:{node.lineno}: core.{node.attr} (only handle and view)")
        elif node.attr in COMPONENTS:
            out.append(f"{path.name}:{node.lineno}: .{node.attr} names a component of the core")
    return out


def test_the_shells_drive_the_core_only_through_handle_and_read_it_only_through_its_view() -> None:
    assert SHELLS, "no shell module found"
    found = [v for p in SHELLS for v in violations(p)]
    assert not found, "\n".join(found)


def test_the_rule_sees_a_reach_into_the_core(tmp_path: Path) -> None:
    """Guards the test against a reader that sees nothing."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self):\n    self.core.tick()\n    x = self.core.view\n    return x.cycle\n")
    found = sorted(violations(bad))
    assert len(found) == 2 and "core.tick" in found[0] and ".cycle" in found[1], found
