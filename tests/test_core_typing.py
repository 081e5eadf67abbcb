"""The control core and the policies are type-checked with mypy --strict's flags (issue 50, item 6): the
pyproject override that turns them on covers exactly the core's import closure (the packages core/ and policy/
whole, and the modules outside them it imports) (tests/test_core_import_contract.py
computes it), so a module the core starts importing is checked strictly from then on, and the flags are strict's
(the ones `mypy --strict` adds that a per-module override can set)."""
from __future__ import annotations

from pathlib import Path

import tomllib
from test_core_import_contract import static_closure

STRICT_FLAGS = {"disallow_any_generics", "disallow_untyped_calls", "disallow_incomplete_defs",
                "disallow_untyped_decorators", "disallow_subclassing_any", "warn_return_any", "no_implicit_reexport",
                "strict_equality", "extra_checks"}
"""``mypy --strict`` less the global-only flags (warn_unused_configs, warn_unused_ignores and warn_redundant_casts
are set globally in pyproject; disallow_untyped_defs and check_untyped_defs for the whole package)."""


def _strict_override() -> dict[str, object]:
    conf = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    mypy = conf["tool"]["mypy"]
    overrides = [o for o in mypy["overrides"] if STRICT_FLAGS <= {k for k, v in o.items() if v is True}]
    assert len(overrides) == 1, "one override carries strict's flags"
    assert mypy["warn_unused_ignores"] and mypy["warn_redundant_casts"] and mypy["check_untyped_defs"]
    return dict(overrides[0])


def _package_modules(package: str) -> set[str]:
    root = Path(__file__).resolve().parent.parent / package.replace(".", "/")
    return {package} | {f"{package}.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}


def test_the_strict_override_covers_exactly_the_core_closure() -> None:
    closure = {m for m in static_closure() if m.startswith("flodl_exp")}
    assert "flodl_exp.core.control_core" in closure and "flodl_exp.policy.base" in closure
    listed = _strict_override()["module"]
    assert isinstance(listed, list)
    wild = [m[:-2] for m in listed if m.endswith(".*")]
    assert sorted(wild) == ["flodl_exp.core", "flodl_exp.policy"], "the core's and the policies' packages, whole"
    covered = {m for m in listed if not m.endswith(".*")} | {m for w in wild for m in _package_modules(w)}
    missing, extra = sorted(closure - covered), sorted(covered - closure)
    assert not missing, f"add to pyproject's strict override (the core imports them now): {missing}"
    assert not extra, f"not the core's (drop from pyproject's strict override, or from the package): {extra}"
