"""Hydra's composition and override errors as one ``config error:`` line and exit 2, like :class:`ConfigError`'s.

Hydra answers a misspelt option, key or group in its own voice: the option list (with the always-refused
``nccl_async``), the config search path, "To append to your config use +key=value" for a misspelt key (following it
leads to a second, different error), nothing about a ``./conf`` the user forgot to pass with ``--config-dir``, and
exit 1. README promises one line and exit 2 for every configuration mistake, so:

* :func:`explain` turns such an exception into that line (pure: the exception and what is available in, the line
  out; ``None`` for anything that is not a composition error, which Hydra then reports as before);
* :func:`one_line_config_errors` puts it on the CLI's path, around the Hydra app, for single runs, ``-m`` sweeps,
  Optuna studies and ``--cfg``.

``HYDRA_FULL_ERROR=1`` set by the user keeps Hydra's own report (and its stack trace) untouched.
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException, SearchPathException
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import BooleanNode, BytesNode, EnumNode, FloatNode, IntegerNode, PathNode, StringNode

from flodl_exp.config import _err, did_you_mean
from flodl_exp.failure_cause import first_line

REFUSED_OPTIONS: Mapping[str, frozenset[str]] = {"mode": frozenset({"nccl_async"})}
"""Group -> options kept under conf/ only so that choosing them gets the reason they are refused (config.py's
validation); never offered in a list of what is available."""

LOCAL_CONF = "conf"
"""The folder, under the current one, that a user's own presets live in (``--config-dir ./conf``)."""

_COMPOSITION_ERRORS = (ConfigCompositionException, OverrideParseException, SearchPathException)

_NODE_KINDS: Sequence[tuple[type, str]] = (
    (BooleanNode, "true or false"), (IntegerNode, "an integer"), (FloatNode, "a number"), (StringNode, "a string"),
    (PathNode, "a path"), (BytesNode, "bytes"), (ListConfig, "a list ([a,b,...])"), (DictConfig, "a mapping ({k: v,...})"),
)


def raised_by_a_job(ex: BaseException) -> bool:
    """Whether ``ex`` came out of the task function (Hydra's ``run_job``): the app's own error, never a
    composition error even when its type says so (a job may compose configs of its own)."""
    return any(frame.f_code.co_name == "run_job" and frame.f_globals.get("__name__") == "hydra.core.utils"
               for frame, _ in traceback.walk_tb(ex.__traceback__))


def explain(ex: BaseException, *, groups: Sequence[str] = (), cwd: Optional[Path] = None) -> Optional[str]:
    """The one ``config error:`` line for a Hydra composition/override error, or None when ``ex`` is not one.

    ``groups``: every config group path of the search path (``mode``, ``hydra/sweeper``...), the candidates for a
    misspelt group; ``cwd``: the folder the command runs in, whose ``./conf`` may hold an option Hydra did not
    find (``--config-dir`` forgotten)."""
    if not isinstance(ex, _COMPOSITION_ERRORS) or raised_by_a_job(ex):
        return None
    if isinstance(ex, MissingConfigException):
        return _missing(ex, cwd)
    if isinstance(ex, OverrideParseException):
        return _unparsable(ex)
    cause = _omegaconf_cause(ex)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.key is not None:
        return _unknown_key(ex, cause, groups)
    if isinstance(cause, ValidationError) and cause.full_key:
        return str(_err(str(cause.full_key), cause.value, _expected(cause.child_node) or first_line(str(cause.msg))))
    said = _flat(str(ex))
    why = first_line(str(cause.msg)) if cause is not None else ""
    return f"config error: {said}" + (f": {why}" if why and why not in said else "")


def _missing(ex: MissingConfigException, cwd: Optional[Path]) -> str:
    """An option (``mode=nccl_cadense``) or a primary config (``--config-name``) that is not on the search path."""
    path = ex.missing_cfg_file or ""
    text = str(ex)
    if ex.options is None:
        if text.startswith("Cannot find primary config"):
            return f"config error: --config-name={path}: no such primary config{_local_hint(cwd, path)}"
        return "config error: " + _flat(text)
    group, _, option = path.rpartition("/")
    options = [o for o in ex.options if o not in REFUSED_OPTIONS.get(group, frozenset())]
    named = f" (named in {_preset(text)}.yaml)" if _preset(text) else ""
    line = f"config error: {group}={option}{named}: no such option (available: {', '.join(options) or 'none'})"
    hint = _local_hint(cwd, path)
    if hint:
        return line + hint
    guess = did_you_mean(option, options)
    return line + (f"; did you mean {guess}?" if guess else "")


def _preset(text: str) -> str:
    """The group preset (``experiment/my_task``) a Hydra message starts "In '...':" with, or "": the primary config
    and Hydra's own (``hydra/config``) name nothing the user wrote (a command-line override lands there too)."""
    where = text[len("In '"):].partition("'")[0] if text.startswith("In '") else ""
    return where if "/" in where and not where.startswith("hydra/") else ""


def _local_hint(cwd: Optional[Path], path: str) -> str:
    """``; ./conf/<path>.yaml exists: add --config-dir ./conf`` when it does (the user's presets, not passed)."""
    if cwd is None or not (cwd / LOCAL_CONF / f"{path}.yaml").is_file():
        return ""
    return f"; ./{LOCAL_CONF}/{path}.yaml exists: add --config-dir ./{LOCAL_CONF}"


def _unparsable(ex: OverrideParseException) -> str:
    lines = [ln.strip() for ln in ex.message.splitlines() if ln.strip()]
    see = next((ln[len("See "):].partition(" ")[0] for ln in lines if ln.startswith("See ")), "")
    reason = next((ln for ln in lines if not ln.startswith("See ")), "cannot be parsed")
    return f"config error: {ex.override}: not a valid override: {reason}" + (f" (see {see})" if see else "")


def _unknown_key(ex: BaseException, cause: OmegaConfBaseException, groups: Sequence[str]) -> str:
    """A key (``mode.max_overshot``) or group (``experment``) the config does not have: what was meant, never
    Hydra's "+key" advice (it adds the misspelt key, which the validation refuses next)."""
    key = str(cause.key)
    full = str(cause.full_key or key)
    text = str(ex)
    typed = text.partition("To append to your config use +")[2].strip()  # the override as the user wrote it
    if not typed and _preset(text):  # a preset sets it, not the command line
        typed = f"{full} (set in {_preset(text)}.yaml)"
    parent, _, leaf = full.rpartition(".")
    keys = _keys_of(cause)
    # the misspelt name is matched against its siblings' names (the shared "mode." would make any key look close)
    if "/" in key:  # a config group: hydra/sweper among hydra's groups
        above, _, leaf = key.rpartition("/")
        siblings = [g for g in groups if g.rpartition("/")[0] == above]
        what, label, names = "no such config group", "groups", {g.rpartition("/")[2]: g for g in siblings}
    elif not parent:
        what, label, names = "no such key or config group", "keys", {k: k for k in keys}
        names.update((g, g) for g in groups if "/" not in g)
    else:
        what, label, names = f"no such key in {parent}", "keys", {k: f"{parent}.{k}" for k in keys}
    shown = typed or full
    guess = did_you_mean(leaf, names)
    if guess:
        return f"config error: {shown}: {what}; did you mean {names[guess]}?"
    listed = list(names.values()) if "/" in key else keys
    return f"config error: {shown}: {what}" + (f" ({label}: {', '.join(listed)})" if listed else "")


def _keys_of(cause: OmegaConfBaseException) -> List[str]:
    """The keys next to the unknown one: its parent node's, else its schema dataclass's."""
    node = getattr(cause, "parent_node", None)
    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    kind = getattr(cause, "object_type", None)
    if isinstance(kind, type) and is_dataclass(kind):
        return [f.name for f in fields(kind)]
    return []


def _expected(node: Any) -> Optional[str]:
    """What a typed node accepts, in the words of config.py's messages (``an integer``, ``... or null``)."""
    if isinstance(node, EnumNode):
        kind: Optional[str] = "one of " + ", ".join(m.name for m in node.enum_type)
    else:
        kind = next((words for cls, words in _NODE_KINDS if isinstance(node, cls)), None)
    if kind is None:
        return None
    return kind + (" or null" if node._is_optional() else "")


def _omegaconf_cause(ex: BaseException) -> Optional[OmegaConfBaseException]:
    """OmegaConf's error under Hydra's: the ``raise ... from`` cause, or the one being handled when it was raised."""
    for inner in (ex.__cause__, ex.__context__):
        if isinstance(inner, OmegaConfBaseException):
            return inner
    return None


def _flat(text: str) -> str:
    """A multi-line Hydra message as one line, without its search-path listing and OmegaConf's key/type trailer."""
    kept: List[str] = []
    for raw in text.splitlines():
        ln = raw.strip().replace("\\'", "'")  # Hydra escapes the quotes of its examples
        if ln.startswith(("Config search path:", "Search path:")):
            break
        if ln and not ln.startswith(("full_key:", "object_type=", "reference_type=")):
            kept.append(ln.rstrip(":"))
    return "; ".join(kept)


# -- on the CLI's path ----------------------------------------------------------------------------------------

class _Refused(BaseException):
    """A composition error, already one line. A BaseException, so that it passes Hydra's ``run_and_report`` (which
    prints and exits 1 on any Exception) and everything between it and :func:`one_line_config_errors`."""


def _all_groups() -> List[str]:
    """Every config group path of the running app's search path (``mode``, ``hydra/sweeper``...), from Hydra's own
    config loader; empty once Hydra has been torn down."""
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    if not gh.is_initialized():
        return []
    loader = gh.config_loader()
    found: List[str] = []
    todo = [""]
    while todo:
        parent = todo.pop()
        for name in loader.list_groups(parent):
            path = f"{parent}/{name}" if parent else name
            found.append(path)
            todo.append(path)
    return found


def _line_or_none(ex: BaseException, groups: Callable[[], Sequence[str]]) -> Optional[str]:
    """:func:`explain`, but never raising: a slip here must leave Hydra's own report, not replace it."""
    try:
        return explain(ex, groups=groups(), cwd=Path.cwd())
    except Exception:
        return None


@contextmanager
def one_line_config_errors() -> Iterator[None]:
    """Around the Hydra app: a composition or override error ends the command with one ``config error:`` line on
    stderr and exit 2; anything else (the app's own exceptions, a failed sweep job) is reported by Hydra as before.

    Hydra reports errors in ``hydra._internal.utils.run_and_report``, which prints them and exits 1 (or re-raises
    under ``HYDRA_FULL_ERROR=1``). For the duration of the app, each function Hydra hands it is wrapped so that a
    composition error leaves as :class:`_Refused` instead; everything else reaches the original unchanged. No
    environment variable is set (the job's processes inherit the environment), and a user's
    ``HYDRA_FULL_ERROR=1`` turns all of this off."""
    from hydra._internal import utils as hydra_utils

    original = getattr(hydra_utils, "run_and_report", None)
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or original is None:
        yield
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composing() -> Any:
            try:
                return func()
            except Exception as ex:
                line = _line_or_none(ex, _all_groups)
                if line is None:
                    raise
                raise _Refused(line) from None

        return original(composing)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    except _Refused as refused:
        _refuse(str(refused))
    except _COMPOSITION_ERRORS as ex:  # composed outside run_and_report (--help, --info): raised as is
        line = _line_or_none(ex, list)
        if line is None:
            raise
        _refuse(line)
    finally:
        hydra_utils.run_and_report = original


def _refuse(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    sys.exit(2)
