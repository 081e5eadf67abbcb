"""mkdocs hook: the configuration reference, generated from the config dataclasses at build time.

``docs/reference/configuration.md`` holds markers (``<!-- config-reference:main -->`` and the like); this hook
replaces each with tables walked from the structured configs (``dataclasses.fields`` of the schema Hydra's
ConfigStore holds: ``flodl_exp.config.Config`` for the main app, ``BenchConfig`` for the bench suite,
``SimulateConfig`` for the simulator), so the page cannot drift from the code. Each key's description is its
attribute docstring in the source (the string literal right after the field) or, failing that, a trailing
``# comment`` on the field's line; a field with neither says so in the table rather than getting invented text.

Registered under ``hooks:`` in mkdocs.yml. ``render(name)`` and ``rows(name)`` are importable for the tests.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import re
import sys
import tokenize
import typing
from functools import cache
from pathlib import Path
from typing import Any, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/configuration.md"
MARKER = re.compile(r"<!--\s*config-reference:(\w+)\s*-->")
NO_DESCRIPTION = "*(no description in the source)*"

# marker name -> (module, root dataclass, key prefix shown in the tables)
ROOTS: dict[str, tuple[str, str]] = {
    "main": ("flodl_exp.config", "Config"),
    "bench": ("flodl_exp.bench.suite", "BenchConfig"),
    "simulate": ("flodl_exp.simulate.topology", "SimulateConfig"),
}


class Row(NamedTuple):
    key: str
    """Dotted key (``mode.anchor``; ``ranks[].count`` for the fields of a list of dataclasses)."""
    type: str
    default: str
    description: str
    """Markdown, already escaped for a table cell; NO_DESCRIPTION when the source has none."""
    owner: str
    """``module.Class`` the field is declared in."""


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        if str(ROOT) not in sys.path:  # a checkout without an installed flodl_exp
            sys.path.insert(0, str(ROOT))
        return importlib.import_module(module)


# -- descriptions from the source ----------------------------------------------
@cache
def _module_docs(path: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its attribute docstring, or its trailing comment, in one source file."""
    source = Path(path).read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    docs: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            text = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                text = inspect.cleandoc(nxt.value.value)
            elif (stmt.end_lineno or stmt.lineno) in comments:
                text = comments[stmt.end_lineno or stmt.lineno]
            if text:
                docs[(node.name, stmt.target.id)] = text
    return docs


def _class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    # a dataclass without a docstring gets a generated signature as __doc__: not a description
    return "" if not doc or doc.startswith(cls.__name__ + "(") else inspect.cleandoc(doc)


_CODE = re.compile(r"(`+)(.+?)\1", re.S)


def _cell(text: str) -> str:
    """One table cell: one line; ``<``, ``>``, ``&``, ``*`` and ``|`` escaped outside code spans."""
    text = " ".join(text.split())
    out: list[str] = []
    pos = 0
    for m in _CODE.finditer(text):
        out.append(_escape(text[pos:m.start()]))
        out.append("<code>" + _html(m.group(2).strip()).replace("|", "&#124;") + "</code>")
        pos = m.end()
    out.append(_escape(text[pos:]))
    return "".join(out)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _escape(text: str) -> str:
    return _html(text).replace("|", "&#124;").replace("*", "\\*").replace("_", "\\_")


# -- types and defaults ---------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        name = " | ".join(_type_name(a) for a in inner)
        return f"{name} | None" if len(inner) < len(args) else name
    if origin in (list, typing.List):
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin in (dict, typing.Dict):
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]" if args else "dict"
    if tp is typing.Any:
        return "Any"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "???" if value == "???" else (value if value else '""')
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _value({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"


def _list_item_dataclass(tp: Any) -> type | None:
    """The element type of ``List[SomeDataclass]`` (or Optional of it), else None."""
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else None
    if typing.get_origin(tp) in (list, typing.List):
        (arg,) = typing.get_args(tp) or (None,)
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field[Any], Any]]:
    """Every leaf field under ``cls``: (dotted key, declaring class, field, resolved type). A dataclass-typed
    field is a section (walked, not a leaf); a list of dataclasses is a leaf and its element's fields follow as
    ``key[].field``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            yield from walk(tp, key + ".")
            continue
        yield key, cls, f, tp
        item = _list_item_dataclass(tp)
        if item is not None:
            yield from walk(item, key + "[].")


def rows(name: str) -> list[Row]:
    module_name, root = ROOTS[name]
    cls = getattr(_import(module_name), root)
    out = []
    for key, owner, f, tp in walk(cls):
        source = inspect.getsourcefile(owner)
        text = _module_docs(source).get((owner.__name__, f.name), "") if source else ""
        out.append(Row(key, _type_name(tp), _value(_default(f)), _cell(text) if text else NO_DESCRIPTION,
                       f"{owner.__module__}.{owner.__qualname__}"))
    return out


def sections(name: str) -> list[tuple[str, str, list[Row]]]:
    """(section key, section description, rows) in declaration order: the top-level leaves first ("" key),
    then one section per dataclass-typed top-level field (``mode``, ``cluster``, ...)."""
    module_name, root = ROOTS[name]
    cls = getattr(_import(module_name), root)
    hints = typing.get_type_hints(cls)
    groups: dict[str, tuple[str, list[Row]]] = {"": (_class_doc(cls), [])}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            groups[f.name] = (_class_doc(tp), [])
    for row in rows(name):
        head = row.key.split(".", 1)[0] if "." in row.key.split("[]", 1)[0] else ""
        groups[head if head in groups else ""][1].append(row)
    return [(k, doc, rs) for k, (doc, rs) in groups.items() if rs]


def _table(rs: list[Row]) -> str:
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for r in rs:
        # "|" would end the cell and "_x_" (guard._target_) would turn into emphasis: both as entities
        key, tp, default = (_html(v).replace("|", "&#124;").replace("_", "&#95;") for v in (r.key, r.type, r.default))
        lines.append(f"| <code>{key}</code> | <code>{tp}</code> | <code>{default}</code> | {r.description} |")
    return "\n".join(lines)


def _groups_table() -> str:
    """The main app's config groups: the presets shipped in flodl_exp/conf/<group>/ and the default choice."""
    from omegaconf import OmegaConf

    conf = Path(_import("flodl_exp").__file__).parent / "conf"
    defaults: dict[str, str] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(conf / "config.yaml")).get("defaults", []):  # type: ignore[union-attr]
        if isinstance(entry, dict):
            defaults.update({str(k): str(v) for k, v in entry.items()})
    lines = ["| group | default | presets (`flodl_exp/conf/<group>/`) |", "|---|---|---|"]
    for group in sorted(defaults):
        folder = conf / group
        if not folder.is_dir():
            continue
        presets = ", ".join(f"`{p.stem}`" for p in sorted(folder.glob("*.yaml")))
        lines.append(f"| `{group}` | `{defaults[group]}` | {presets} |")
    return "\n".join(lines)


def render(name: str) -> str:
    parts: list[str] = []
    if name == "main":
        parts += ["### Config groups", "", _groups_table(), ""]
    for key, doc, rs in sections(name):
        title = f"`{key}`" if key else "Top-level keys"
        parts += [f"### {title}", ""]
        if doc:
            parts += [_cell(doc), ""]
        parts += [_table(rs), ""]
    undocumented = [r.key for r in rows(name) if r.description == NO_DESCRIPTION]
    parts.append(f"{len(rows(name))} keys, {len(undocumented)} without a description in the source.")
    return "\n".join(parts)


# -- the mkdocs hook --------------------------------------------------------------
def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    _module_docs.cache_clear()  # mkdocs serve rebuilds in one process: read the sources as they are now
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
