"""The control core's import contract (issue 50, item 1), as a ratchet while the core is made sans-I/O step by step.

The core is ``flodl_exp.control.core`` and every flodl_exp module it loads. It must load no module of the shell
(sockets, files, trackers, the coordinator's process): that part is enforced outright. What it must not import
either, but still does, is listed in :data:`REMAINING` with the step that removes it. The test fails when anything
joins that list, and also when an entry is gone, so that each step tightens it. Imports are read from each module's
source (``ast``, any depth, lazy ones included): ``os`` and ``time`` are loaded by the interpreter itself, so
``sys.modules`` cannot tell who imports them.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

FORBIDDEN = ("time", "os", "socket", "select", "threading", "torch", "mlflow", "flodl_exp.wire")
"""What the core may not import: the clock comes in with each event; tensors, files and sockets are behind ports."""

SHELL = ("flodl_exp.wire", "flodl_exp.codec", "flodl_exp.control.wire_outbox", "flodl_exp.control.event_log", "flodl_exp.control.records",
         "flodl_exp.control.watchdog", "flodl_exp.control.server", "flodl_exp.control.coordinator",
         "flodl_exp.control.main", "flodl_exp.control.timeline", "flodl_exp.tracking", "flodl_exp.fsio",
         "flodl_exp.jobs", "flodl_exp.rank", "flodl_exp.simulate")
"""Modules of the shell: the core loads none of them (enforced now). The payloads (``protocol.py``) are the core's;
their codec (``codec.py``) and the wire (frames, sockets, threads) are the shell's."""

REMAINING: dict[str, set[str]] = {
    # the cpu backend's averaging and outer step import torch on first use: behind an Averager port next
    "flodl_exp.control.cycle": {"torch"},
    # the bundle writer's file names and the preemption mark's path (os.path only): behind the BundleStore port next
    "flodl_exp.control.bundle_store": {"os"},
    "flodl_exp.control.checkpoints": {"os", "time"},
    # a rank's silence is measured against time.monotonic(): the time to come with each event
    "flodl_exp.control.cohort": {"time"},
    # the config's defaults read the environment and the working directory (tracking URI, job root)
    "flodl_exp.config": {"os"},
    "flodl_exp.constants": {"os"},
    # the per-rank scalar reductions' registry is guarded by a lock
    "flodl_exp.scalars": {"threading"},
}


def _closure() -> list[str]:
    code = ("import sys; before = set(sys.modules); import flodl_exp.control.core, flodl_exp.control.commands; "
            "print('\\n'.join(sorted(m for m in set(sys.modules) - before if m.startswith('flodl_exp'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _source(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def forbidden_imports(module: str) -> set[str]:
    """The :data:`FORBIDDEN` names ``module``'s source imports, anywhere in it."""
    tree = ast.parse(_source(module).read_text())
    for node in ast.walk(tree):  # what is imported only for annotations never runs
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.add(node.module)
            elif node.level and node.module:  # from ..wire import Message -> flodl_exp.wire
                base = module.split(".")[: -node.level] if not _source(module).name == "__init__.py" else \
                    module.split(".")[: len(module.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module]))
    return {f for f in FORBIDDEN if any(n == f or n.startswith(f + ".") for n in names)}


def test_the_core_loads_no_module_of_the_shell() -> None:
    closure = _closure()
    assert "flodl_exp.control.core" in closure and len(closure) > 20  # the probe saw the core
    shell = [m for m in closure if any(m == s or m.startswith(s + ".") for s in SHELL)]
    assert not shell, f"the core loads the shell's {shell}"


def test_what_the_core_still_imports_is_only_what_is_known_and_shrinks() -> None:
    found = {m: f for m in _closure() if (f := forbidden_imports(m))}
    assert found == REMAINING, (
        "the core's forbidden imports changed: a new one is a regression; a gone one is progress, so remove it "
        f"from REMAINING.\nfound:     {found}\nremaining: {REMAINING}")


def test_the_reader_sees_relative_and_lazy_imports() -> None:
    """Guards the ratchet against passing on a reader that sees nothing."""
    assert forbidden_imports("flodl_exp.codec") == {"flodl_exp.wire"}  # from .wire import Message
    assert "torch" not in forbidden_imports("flodl_exp.protocol")  # only under TYPE_CHECKING
    assert "time" in forbidden_imports("flodl_exp.control.coordinator")
    assert "socket" in forbidden_imports("flodl_exp.wire")
