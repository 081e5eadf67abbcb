"""Pre-flight: every dotted path the experiment names resolves, checked in the launcher before any job folder,
MLflow run or process exists.

A wrong ``_target_`` (``my_model.Nett``) or a module the launch folder cannot import used to surface seconds later,
from a rank, after a job folder and a FAILED MLflow run (and, launched from the wrong folder, a second MLflow store)
had been made. Here the same import context as the tasks' (``JobSpec.import_paths`` first, then this interpreter's
``sys.path``) is asked first, and a failure is one ``config error:`` line naming the key, the target and the real
cause.

Most paths are checked without running the user's code: the module is *found* (``importlib.util.find_spec``, which
runs no module body for a top-level name; ``PathFinder`` for a submodule, which does not import its package) and
the attribute is looked up among the names its source binds at top level (``ast``). Importing a user's model
module here would import torch, ~1.5 s before the job could start. Only where that static look says "missing"
is the module really imported (``hydra.utils.get_object``), so that what is reported is Python's own cause and a
dynamic module (``__getattr__``, ``import *``, names bound in a loop) is never refused by mistake.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp.config import ConfigError

PATH_KEYS = ("train_step", "loop", "eval_fn", "epoch_fn", "checkpoint_fn")
"""The experiment's plain-string dotted paths (each ``fn`` the ranks look up with ``get_method``)."""


@dataclass(frozen=True)
class DottedPath:
    """One dotted path of the config: where it is (``experiment.model._target_``) and what it names."""

    key: str
    target: str


def dotted_paths(experiment: Mapping[str, Any], prefix: str = "experiment") -> list[DottedPath]:
    """Every dotted path ``experiment`` names: each ``_target_`` at any depth, and the function keys."""
    found: list[DottedPath] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, Mapping):
            target = node.get("_target_")
            if isinstance(target, str) and target:
                found.append(DottedPath(f"{key}._target_", target))
            for k, v in node.items():
                if k != "_target_":
                    walk(v, f"{key}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")

    for k, v in experiment.items():
        if k in PATH_KEYS:
            if isinstance(v, str) and v:
                found.append(DottedPath(f"{prefix}.{k}", v))
        else:
            walk(v, f"{prefix}.{k}")
    return found


# -- the static look: find the module, read the names its source binds --------------------------------------
StarNames = Callable[[Optional[str], int], Optional[set[str]]]
"""``(module, level) -> names`` of a ``from module import *`` (``level``: its leading dots), None = unknown."""


class _Unknowable(Exception):
    """The source binds names it does not show (a module ``__getattr__``, an unlistable ``import *``)."""


class _TopLevel:
    """The names a module body binds, statement by statement; nested blocks that run at import time are read too,
    function and class bodies are not."""

    def __init__(self, star: Optional[StarNames]) -> None:
        self.star = star
        self.names: set[str] = set()

    def targets(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            self.names.add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self.targets(elt)
        elif isinstance(node, ast.Starred):
            self.targets(node.value)

    def block(self, stmts: Iterable[ast.stmt]) -> None:
        for st in stmts:
            self.statement(st)

    def statement(self, st: ast.stmt) -> None:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if st.name == "__getattr__":
                raise _Unknowable
            self.names.add(st.name)
        elif isinstance(st, ast.Assign):
            for t in st.targets:
                self.targets(t)
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
            self.targets(st.target)
        elif isinstance(st, ast.Import):
            self.names.update(a.asname or a.name.split(".")[0] for a in st.names)
        elif isinstance(st, ast.ImportFrom):
            self.import_from(st)
        else:
            self.compound(st)

    def import_from(self, st: ast.ImportFrom) -> None:
        for a in st.names:
            if a.name != "*":
                self.names.add(a.asname or a.name)
                continue
            more = self.star(st.module, st.level) if self.star is not None else None
            if more is None:
                raise _Unknowable
            self.names.update(more)

    def compound(self, st: ast.stmt) -> None:
        if isinstance(st, (ast.For, ast.AsyncFor)):
            self.targets(st.target)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                if item.optional_vars is not None:
                    self.targets(item.optional_vars)
        for h in getattr(st, "handlers", ()):  # try / try*: the handlers' names and bodies
            if h.name:
                self.names.add(h.name)
            self.block(h.body)
        for field in ("body", "orelse", "finalbody"):
            if isinstance(st, (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try)) or \
                    type(st).__name__ == "TryStar":
                self.block(getattr(st, field, ()))


def bound_names(source: str, star: Optional[StarNames] = None) -> Optional[set[str]]:
    """The names a module's top level binds (defs, classes, assignments, imports, also inside top-level ``if`` /
    ``try`` / ``with`` / ``for``), or None where the source cannot say (a module ``__getattr__``, a write to
    ``globals()``, a syntax error, a ``from x import *`` that ``star`` cannot list)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "globals" for n in ast.walk(tree)):
        return None  # globals()[...] = / globals().update(...): names the source does not show
    reader = _TopLevel(star)
    try:
        reader.block(tree.body)
    except _Unknowable:
        return None
    return reader.names


def _source_of(spec: importlib.machinery.ModuleSpec) -> Optional[str]:
    origin = spec.origin
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None  # an extension module, a frozen or namespace package: nothing to read
    try:
        with open(origin, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def _find_top(name: str) -> Optional[importlib.machinery.ModuleSpec]:
    try:
        return importlib.util.find_spec(name)  # a top-level name: found, not imported (meta path finders included)
    except (ImportError, ValueError):
        return None


STAR_DEPTH = 3
"""How many ``from x import *`` deep the static look follows (``torch.nn`` -> ``torch.nn.modules``: 1)."""


def _module_names(spec: importlib.machinery.ModuleSpec, depth: int) -> Optional[set[str]]:
    """The names the module of ``spec`` binds at top level, following its star imports ``depth`` deep."""
    source = _source_of(spec)
    if source is None:
        return None
    package = spec.name if spec.submodule_search_locations is not None else spec.name.rpartition(".")[0]

    def star(module: Optional[str], level: int) -> Optional[set[str]]:
        if depth <= 0:
            return None
        try:
            name = importlib.util.resolve_name("." * level + (module or ""), package) if level else str(module)
        except (ImportError, ValueError):
            return None
        found = _spec_of(name)
        names = _module_names(found, depth - 1) if found is not None else None
        return None if names is None else {n for n in names if not n.startswith("_")}

    return bound_names(source, star)


def _spec_of(name: str) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of module ``name`` without importing it (its packages are found on disk, not run)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return getattr(loaded, "__spec__", None)
    head, _, tail = name.rpartition(".")
    if not head:
        return _find_top(name)
    parent = _spec_of(head)
    if parent is None or parent.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(name, list(parent.submodule_search_locations))


def static_verdict(target: str) -> Optional[bool]:
    """True: ``target`` resolves; False: it looks missing; None: the source cannot tell (the caller imports).

    A module already imported here is read from ``sys.modules`` (its attribute looked up for real: free); the
    rest is found on disk and read, never run: ``flodl_exp`` is loaded in the launcher, ``flodl_exp.zoo.digits``
    (which imports torch) is not, and must not be for the check."""
    parts = target.split(".")
    if any(not p.isidentifier() for p in parts):
        return False
    spec: Optional[importlib.machinery.ModuleSpec] = None
    for i, part in enumerate(parts):
        name = ".".join(parts[:i + 1])
        parent = sys.modules.get(".".join(parts[:i])) if i else None
        if parent is not None and hasattr(parent, part) and not isinstance(getattr(parent, part), type(sys)):
            return True  # an attribute of a loaded module (a submodule attribute goes on down the path)
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
            if spec is None:
                return None
            continue
        if spec is None:
            spec = _find_top(part)
            if spec is None:
                return False
            continue
        locations = spec.submodule_search_locations
        if locations is not None:
            sub = importlib.machinery.PathFinder.find_spec(name, list(locations))
            if sub is not None:
                spec = sub
                continue
        names = _module_names(spec, STAR_DEPTH)
        if names is None:
            return None
        return part in names  # what follows is an attribute of that object: not ours to read
    return True  # the whole path is a module (a ``_target_`` that names a module is for hydra to refuse)


# -- the real look-up, and the one line -----------------------------------------------------------------------
def _real_cause(target: str) -> Optional[BaseException]:
    """None if ``target`` imports and resolves, else the exception hydra's own look-up (the ranks' path) raises."""
    import logging

    from hydra.utils import get_object

    log = logging.getLogger("hydra.utils")  # it logs an error of its own before raising: ours is the one line
    was, log.disabled = log.disabled, True
    try:
        get_object(target)
    except Exception as e:  # the user's module may raise anything at import
        return e
    finally:
        log.disabled = was
    return None


def _module_missing(target: str) -> Optional[str]:
    """The top-level module of ``target`` when no finder can find it (else None)."""
    top = target.split(".")[0]
    return top if top not in sys.modules and _find_top(top) is None else None


def _nearby(module: str, folders: Sequence[str]) -> Optional[str]:
    """The folder among ``folders`` (and their parents) that holds ``module`` as a file or package."""
    for folder in folders:
        for d in (folder, os.path.dirname(folder.rstrip(os.sep))):
            if os.path.isfile(os.path.join(d, f"{module}.py")) or os.path.isfile(os.path.join(d, module, "__init__.py")):
                return d
    return None


def _cause_line(target: str, cause: BaseException) -> str:
    """Python's cause, said plainly: hydra wraps a missing attribute as 'Error loading ...' with the real error in
    its message's last line or its ``__cause__``."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then the missing name
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            if not hasattr(mod, parts[i]):
                return f"module '{mod.__name__}' has no attribute '{parts[i]}'"
            break
    inner = cause.__cause__ or cause.__context__ or cause
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}".rstrip(": ")


def unimportable_line(module: str, launch_dir: str, config_dirs: Sequence[str]) -> str:
    """The module of a path cannot be found from the launch folder: where it is, if it is next to the config."""
    where = _nearby(module, config_dirs)
    if where is not None and os.path.abspath(where) != os.path.abspath(launch_dir):
        return (f"{module} is not importable from {launch_dir}: it is in {where}: launch from there, "
                f"or set PYTHONPATH={where}")
    return f"{module} is not importable from {launch_dir}: launch from the folder that holds it, or set PYTHONPATH"


def check_path(path: DottedPath, launch_dir: str, config_dirs: Sequence[str] = ()) -> Optional[str]:
    """None if ``path`` resolves in this interpreter's import context, else its one ``config error:`` line."""
    if static_verdict(path.target) is True:
        return None
    missing = _module_missing(path.target)
    if missing is not None:
        return f"config error: {path.key}={path.target!r}: {unimportable_line(missing, launch_dir, config_dirs)}"
    cause = _real_cause(path.target)
    if cause is None:
        return None
    return f"config error: {path.key}={path.target!r} cannot be resolved: {_cause_line(path.target, cause)}"


@contextlib.contextmanager
def importable_from(paths: Sequence[str]) -> Iterator[None]:
    """``paths`` first on ``sys.path`` for the block (the tasks' order), finders' caches fresh; as it was after."""
    added = [p for p in dict.fromkeys(paths) if p not in sys.path]
    sys.path[:0] = added
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def config_dirs() -> list[str]:
    """The user's config folders (``--config-dir``, ``hydra.searchpath``) of this Hydra app, if one runs."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return []
        sources = HydraConfig.get().runtime.config_sources
    except Exception:
        return []
    out = []
    for s in sources:
        if str(getattr(s, "schema", "")) == "file" and str(getattr(s, "provider", "")) != "main":
            out.append(os.path.abspath(str(getattr(s, "path", ""))))
    return out


def preflight(experiment: Mapping[str, Any], import_paths: Sequence[str], launch_dir: str,
              hooks: Optional[Mapping[str, Any]] = None, others: Optional[Mapping[str, Any]] = None) -> None:
    """Raise ConfigError (one line) for the first dotted path of ``experiment`` (and of ``hooks``: the coordinator's
    ``metrics_fn`` / ``eval_result_fn``; ``others``: full key -> path, e.g. ``guard._target_``) the tasks could not
    resolve."""
    extra = {**{f"hooks.{k}": v for k, v in (hooks or {}).items()}, **(others or {})}
    paths = dotted_paths(experiment) + [DottedPath(k, v) for k, v in extra.items() if isinstance(v, str) and v]
    if not paths:
        return
    dirs = config_dirs()
    with importable_from(import_paths):
        for p in paths:
            line = check_path(p, launch_dir, dirs)
            if line is not None:
                raise ConfigError(line)


def build_user_classes(groups: Mapping[str, Optional[Mapping[str, Any]]], import_paths: Sequence[str]) -> None:
    """``guard._target_`` / ``outer._target_`` with their ``args``: each class built once here, so a wrong keyword
    or a constructor that raises is one ``config error:`` line before any process starts (in the coordinator it
    would end the job without a result). Only groups that name a class are imported (a rare option: the cost of
    importing the user's module, torch included, is paid only then). ``groups``: group -> its config (a mapping)."""
    with importable_from(import_paths):
        for group, node in groups.items():
            target = (node or {}).get("_target_")
            if not target:
                continue
            args = dict((node or {}).get("args") or {})
            try:  # the run's own builders: what the coordinator and the ranks will build, checked the same way
                if group == "guard":
                    from flodl_exp.policy.guards import build_user_guard

                    build_user_guard(str(target), args)
                else:
                    from flodl_exp.config import OuterSpec
                    from flodl_exp.outer import make_outer

                    make_outer(OuterSpec(target=str(target), args=tuple(sorted(args.items()))))
            except Exception as e:
                cause = str(e).splitlines()[0] if str(e) else ""
                raise ConfigError(f"config error: {group}._target_={target!r} with {group}.args={args!r} cannot be "
                                  f"built: {type(e).__name__}: {cause}") from None


__all__ = ["DottedPath", "dotted_paths", "bound_names", "static_verdict", "check_path", "preflight", "build_user_classes"]
