"""The control core's import contract (issue 50, item 1): the core is sans-I/O.

The core is ``flodl_exp.core.control_core`` and every flodl_exp module it can load: its closure is read from source
(``ast``), following every import at any depth, lazy ones inside functions included, since a lazy import runs
as soon as the core calls that function. A package's ``__init__`` is read at its top level only: importing a
submodule runs that, not the package's functions (``flodl_exp.launch`` is the public facade, never the core's).

Within that closure no module imports :data:`FORBIDDEN` (the clock comes in from the shell; tensors, files and
sockets sit behind the core's ports: the Outbox, the BundleStore, the Averager, the observer) and no module of
the shell (:data:`SHELL`) is reached. A second check imports the core in a fresh interpreter and reads
``sys.modules``, so that a reader that misses an import cannot pass the first.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

FORBIDDEN = ("time", "os", "socket", "select", "threading", "torch", "mlflow", "flodl_exp.protocol.wire")
"""What the core may not import: the clock comes from the shell; tensors, files and sockets are behind ports."""

SHELL = ("flodl_exp.protocol.wire", "flodl_exp.protocol.codec", "flodl_exp.coordinator.wire_outbox", "flodl_exp.coordinator.event_log",
         "flodl_exp.coordinator.records", "flodl_exp.coordinator.watchdog", "flodl_exp.coordinator.server",
         "flodl_exp.coordinator.coordinator", "flodl_exp.coordinator.main", "flodl_exp.coordinator.timeline",
         "flodl_exp.coordinator.disk_bundles", "flodl_exp.torch_averager", "flodl_exp.averaging",
         "flodl_exp.outer", "flodl_exp.checkpoint", "flodl_exp.config_rules", "flodl_exp.package_conf",
         "flodl_exp.scalars", "flodl_exp.tracking", "flodl_exp.fsio", "flodl_exp.jobs", "flodl_exp.rank",
         "flodl_exp.simulate")
"""Modules of the shell: the core reaches none of them. The payloads (``protocol/messages.py``), the bundle's piece names
(``bundle_names.py``) and the config's schemas (``config.py``) are the core's; their codec, the files, the
validation pass that reads the environment, torch's averaging and the outer optimizer are the shell's."""

ROOTS = ("flodl_exp.core.control_core", "flodl_exp.core.commands")


def _source(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_package(module: str) -> bool:
    return _source(module).name == "__init__.py"


def imports_of(module: str) -> set[str]:
    """Every module ``module``'s source imports (a package's ``__init__``: at its top level only), as absolute
    names; ``from pkg import sub`` names ``pkg.sub`` too when that is a module. Annotation-only imports (under
    ``if TYPE_CHECKING:``) never run and are left out."""
    tree = ast.parse(_source(module).read_text())
    nodes: list[ast.AST]
    if _is_package(module):
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
                node.body = []
        nodes = list(ast.walk(tree))
    package = module.split(".") if _is_package(module) else module.split(".")[:-1]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:  # from ..wire import Message -> flodl_exp.protocol.wire
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if _source(f"{base}.{a.name}").exists())
    return names


def static_closure(roots: tuple[str, ...] = ROOTS) -> dict[str, set[str]]:
    """Each flodl_exp module the roots can load (with its parent packages), mapped to what it imports."""
    seen: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen or not _source(module).exists():
            continue
        seen[module] = imports_of(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [m for m in seen[module] if m == "flodl_exp" or m.startswith("flodl_exp.")]
    return seen


def _hits(names: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {p for p in prefixes if any(n == p or n.startswith(p + ".") for n in names)}


def test_the_core_imports_no_clock_file_socket_thread_or_tensor() -> None:
    closure = static_closure()
    assert "flodl_exp.core.cycle" in closure and len(closure) > 30  # the reader saw the core
    found = {m: sorted(f) for m, names in closure.items() if (f := _hits(names, FORBIDDEN))}
    assert not found, f"the core imports what must come through a port or with its events: {found}"


def test_the_core_reaches_no_module_of_the_shell() -> None:
    shell = sorted(m for m in static_closure() if _hits({m}, SHELL))
    assert not shell, f"the core reaches the shell's {shell}"


def test_importing_the_core_loads_no_module_of_the_shell() -> None:
    code = ("import sys; before = set(sys.modules); " + "; ".join(f"import {r}" for r in ROOTS) + "; "
            "print('\\n'.join(sorted(m for m in set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "flodl_exp.core.control_core" in loaded
    assert not _hits(loaded, SHELL), f"importing the core loads the shell's {sorted(_hits(loaded, SHELL))}"
    assert not _hits(loaded, ("torch", "mlflow", "socket", "select")), "importing the core loads I/O libraries"


def test_the_reader_sees_relative_and_lazy_imports() -> None:
    """Guards the contract against passing on a reader that sees nothing."""
    assert "flodl_exp.protocol.wire" in imports_of("flodl_exp.protocol.codec")  # from .wire import Message
    assert "torch" not in imports_of("flodl_exp.protocol.messages")  # only under TYPE_CHECKING
    assert "torch" in imports_of("flodl_exp.torch_averager")  # inside a method
    assert "time" in imports_of("flodl_exp.coordinator.coordinator")
    assert "socket" in imports_of("flodl_exp.protocol.wire")
    assert "flodl_exp.jobs.launcher" not in imports_of("flodl_exp")  # a package's functions are not its top level
    assert _hits(set(static_closure(("flodl_exp.coordinator.coordinator",))), SHELL)  # the shell's closure has it
