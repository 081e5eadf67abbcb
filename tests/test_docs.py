"""The documentation site and README.md's links (make test-package).

- the site builds with ``mkdocs build --strict`` (a broken link, a missing #anchor or a page missing from the nav
  fails it: mkdocs.yml's ``validation`` turns each into a warning, strict into a failure);
- every relative link in README.md resolves to a file of the repository, and its ``#anchor`` to a heading;
- the configuration reference, generated at build time by docs/hooks/config_reference.py, lists every field of
  the config dataclasses (the run's, the bench suite's, the simulator's), each with its docstring (so a key added
  to flodl_exp/config.py shows up in the docs on the next build); a field without an attribute docstring or a
  trailing comment gets the hook's "no description" marker, which fails the test.
"""
from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
HOOK = DOCS / "hooks" / "config_reference.py"
MKDOCS = Path(sys.executable).parent / "mkdocs"
CONFIG_PAGE = DOCS / "reference" / "configuration.md"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_config_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and NamedTuple look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One strict build of the site for the module's tests."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return proc, out


@pytest.mark.package
def test_the_site_builds_strict(site: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = site
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    for page in ("index.html", "quickstart/index.html", "reference/configuration/index.html"):
        assert (out / page).is_file(), page


# -- README's links -----------------------------------------------------------------
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _links(markdown: str) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    return _INLINE_LINK.findall(text) + _REF_DEF.findall(text)


def _slugs(markdown: str) -> set[str]:
    """Anchors of a markdown file's headings, as mkdocs (toc's slugify) and GitHub make them."""
    from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

    out: set[str] = set()
    for raw in _HEADING.findall(_FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw).replace("`", "")  # a link's text, code's text
        out.add(slugify(text, "-"))
        out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text.strip().lower())))  # GitHub's
    return out


@pytest.mark.package
def test_every_relative_link_in_the_readme_resolves() -> None:
    readme = README.read_text(encoding="utf-8")
    links = _links(readme)
    relative = [u for u in links if not re.match(r"^[a-z][a-z0-9+.-]*:", u, re.I)]  # http:, https:, mailto:
    assert len(relative) >= 10, f"README.md links into the docs: expected many relative links, found {relative}"
    broken = []
    for url in relative:
        path, _, anchor = url.partition("#")
        target = (README.parent / path).resolve() if path else README
        if not target.exists() or (target != ROOT and ROOT not in target.parents):
            broken.append(f"{url}: no such file in the repository")
            continue
        if anchor and target.suffix == ".md" and anchor not in _slugs(target.read_text(encoding="utf-8")):
            broken.append(f"{url}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "README.md has links that do not resolve:\n" + "\n".join(broken)


@pytest.mark.package
def test_link_extraction_sees_what_the_readme_checker_needs() -> None:
    """The checker itself: inline links, titles, reference definitions; code is not a link."""
    md = ('See [a](docs/a.md#x) and [`b`](docs/b.md) and [c](docs/c.md "title").\n'
          "`[not](a link)` and\n```\n[nor](this)\n```\n[ref]: docs/d.md\n")
    assert _links(md) == ["docs/a.md#x", "docs/b.md", "docs/c.md", "docs/d.md"]
    assert {"the-coordinators-architecture", "start-up"} <= _slugs("## The coordinator's architecture\n### Start-up\n")


# -- the generated configuration reference ------------------------------------------------
def _leaf_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every configurable key under a dataclass, walked independently of the hook: a dataclass-typed field is a
    section; a list of dataclasses is a key and its element's fields ``key[].field``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp: Any = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _leaf_keys(tp, f"{prefix}{f.name}.")
            continue
        yield f"{prefix}{f.name}"
        if typing.get_origin(tp) is typing.Union:  # Optional[List[...]]
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = inner[0] if len(inner) == 1 else tp
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            yield from _leaf_keys(item, f"{prefix}{f.name}[].")


def _schemas() -> dict[str, type]:
    from flodl_exp.bench.suite import BenchConfig
    from flodl_exp.config import Config
    from flodl_exp.simulate.topology import SimulateConfig

    return {"main": Config, "bench": BenchConfig, "simulate": SimulateConfig}


def _rows(page_html: str) -> list[list[str]]:
    """The cells of every table row of the rendered page, as text."""
    out = []
    for tr in re.findall(r"<tr>(.*?)</tr>", page_html, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        if cells:
            out.append([html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells])
    return out


@pytest.mark.package
def test_the_config_reference_lists_every_field(site: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (out / "reference" / "configuration" / "index.html").read_text(encoding="utf-8")
    rows = _rows(page)
    described = {r[0]: r[3] for r in rows if len(r) == 4}
    hook = _hook()
    for name, schema in _schemas().items():
        keys = list(_leaf_keys(schema))
        assert keys, name
        missing = [k for k in keys if k not in described]
        assert not missing, f"the configuration reference lacks {name} keys {missing} (docs/hooks/config_reference.py)"
        # the hook's own walk agrees (its rows are what the page shows)
        assert [r.key for r in hook.rows(name)] == keys, name
    # every row says what the key does: a field without a docstring (or trailing comment) fails here
    blank = [k for k, d in described.items() if not d]
    assert not blank, f"rows with an empty description: {blank}"
    marker = html.unescape(re.sub(r"<[^>]+>", "", hook.NO_DESCRIPTION)).strip("*")
    undocumented = [f"{r.owner}.{r.key.rsplit('.', 1)[-1]} ({name}: {r.key})" for name in _schemas()
                    for r in hook.rows(name) if r.description == hook.NO_DESCRIPTION]
    assert not undocumented, ("config fields without a description (add an attribute docstring on the line after "
                              f"the field): {undocumented}")
    assert marker not in page, f"the built reference still shows {marker!r}"
    assert described["mode.anchor"].startswith("Slow rank's batches per averaging window")
    assert "config-reference:" not in page  # every marker was replaced


@pytest.mark.package
def test_the_config_reference_is_not_written_by_hand() -> None:
    """The page's source holds only markers where the tables go: the tables come from the code at build time."""
    source = CONFIG_PAGE.read_text(encoding="utf-8")
    assert set(re.findall(r"<!--\s*config-reference:(\w+)\s*-->", source)) == {"main", "bench", "simulate"}
    assert "| key | type |" not in source
    assert not re.search(r"^\|\s*(<code>|`)[\w.\[\]]+(</code>|`)\s*\|", source, re.M), "a hand-written key row"


@pytest.mark.package
def test_descriptions_come_from_docstrings_or_trailing_comments(tmp_path: Path) -> None:
    src = tmp_path / "schema_under_test.py"
    src.write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass C:\n"
        "    a: int = 1\n"
        '    """What a does,\n    over two lines."""\n'
        "    b: int = 2  # what b does\n"
        "    c: int = 3\n"
        "    d: str = 'x'\n"
        '    """d | e <tag> *star*"""\n', encoding="utf-8")
    docs = _hook()._module_docs(str(src))
    assert docs[("C", "a")] == "What a does,\nover two lines."
    assert docs[("C", "b")] == "what b does"
    assert ("C", "c") not in docs
    cell = _hook()._cell(docs[("C", "d")] + " `x | y`")
    assert "|" not in cell and "<tag>" not in cell and "&lt;tag&gt;" in cell and "\\*star\\*" in cell
