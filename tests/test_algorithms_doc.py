"""Every ``algorithms.md <section>`` citation in the repository names a heading of docs/reference/algorithms.md.

Code, tests, configs and docs cite the reference's rules by section number (``algorithms.md 5.6``,
``algorithms.md section 6``, ``algorithms.md 3.2-3.11``, ``algorithms.md §5.1/5.3, 7.2``); the page keeps that
numbering, one heading per section (``### 5.6 ...``) with the anchor ``#s5-6``. A citation of a section the page
lacks, or a link to an anchor it does not have, fails here. Pure file reading: no build, no subprocess.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "algorithms.md"
SCANNED = ("flodl_exp", "docs", "experiments", "tests", "conf", "README.md", "CHANGELOG.md")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".toml", ".cfg"}
SKIP_DIRS = {"__pycache__", ".pytest_cache", "snapshots"}

_NUM = r"\d+(?:\.\d+)?"
_ITEM = rf"§?{_NUM}(?:\s*[-\u2013]\s*{_NUM})?"
# "algorithms.md" then an optional "§" or "section(s)", then a list of numbers or ranges joined by "," or "/".
# A list ends at anything else ("3.1; the shell takes 2-3": the 2-3 are tick steps, not sections).
CITATION = re.compile(rf"algorithms\.md\s+(?:sections?\s+)?({_ITEM}(?:\s*[,/]\s*{_ITEM})*)")
HEADING = re.compile(rf"^#{{2,4}}\s+({_NUM})\.?\s+(.*?)\s*$", re.M)
ANCHOR_ATTR = re.compile(r"\{\s*#([\w-]+)\s*\}\s*$")
LINK = re.compile(r"algorithms\.md#([\w-]+)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def cited_sections(text: str) -> list[str]:
    """The section numbers ``text`` cites, in order: both ends of a range, each item of a list."""
    out: list[str] = []
    for m in CITATION.finditer(text):
        for item in re.split(r"\s*[,/]\s*", m.group(1)):
            out.extend(re.findall(_NUM, item))
    return out


def headings(markdown: str) -> dict[str, str]:
    """Section number -> its anchor, for every numbered heading (## to ####) outside code fences."""
    out: dict[str, str] = {}
    for number, title in HEADING.findall(FENCE.sub("", markdown)):
        attr = ANCHOR_ATTR.search(title)
        out[number] = attr.group(1) if attr else ""
    return out


def unresolved(citations: dict[str, list[str]], known: set[str]) -> list[str]:
    """``where: section`` for each cited section that is not a heading."""
    return [f"{where}: algorithms.md {n}" for where, ns in citations.items() for n in ns if n not in known]


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                    and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    return [p for p in out if p.resolve() != Path(__file__).resolve()]


def _citations() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.setdefault(f"{path.relative_to(ROOT)}:{line}", []).extend(cited_sections(m.group(0)))
    return found


def test_every_cited_section_is_a_heading_of_the_page() -> None:
    known = set(headings(PAGE.read_text(encoding="utf-8")))
    citations = _citations()
    assert sum(map(len, citations.values())) >= 50, f"expected the repository's many citations, found {citations}"
    missing = unresolved(citations, known)
    assert not missing, ("citations of sections docs/reference/algorithms.md has no heading for "
                         "(add the section, or fix the number):\n" + "\n".join(missing))


def test_each_heading_has_its_number_anchor() -> None:
    """``### 5.6 Title { #s5-6 }``: links into the page can be written from the number alone."""
    wrong = {n: a for n, a in headings(PAGE.read_text(encoding="utf-8")).items()
             if a != "s" + n.replace(".", "-")}
    assert not wrong, f"headings whose anchor is not s<number with dashes>: {wrong}"


def test_links_into_the_page_name_existing_anchors() -> None:
    anchors = set(headings(PAGE.read_text(encoding="utf-8")).values())
    broken = [f"{p.relative_to(ROOT)}: #{a}" for p in _files() for a in LINK.findall(p.read_text(encoding="utf-8"))
              if a not in anchors]
    assert not broken, "links to anchors docs/reference/algorithms.md lacks:\n" + "\n".join(broken)


def test_the_citation_grammar() -> None:
    """The checker itself: ranges give both ends, lists every item, and prose after a list is not a section."""
    doc = "algorithms" + ".md"  # kept apart so this file cites nothing itself
    assert cited_sections(f"({doc} 5.6)") == ["5.6"]
    assert cited_sections(f"{doc} section 6.6 and {doc} section 10") == ["6.6", "10"]
    assert cited_sections(f"({doc} 3.2-3.11): the owner") == ["3.2", "3.11"]
    assert cited_sections(f"({doc} \u00a75.1/5.3/5.5/5.8, 7.2, 8.3/8.4)") == ["5.1", "5.3", "5.5", "5.8", "7.2",
                                                                            "8.3", "8.4"]
    assert cited_sections(f"({doc} 4.4, 5, 3.13)") == ["4.4", "5", "3.13"]
    assert cited_sections(f"({doc} 3.1; the shell takes 2-3, heartbeats") == ["3.1"]
    assert cited_sections(f"({doc} 7.3; 0.2 of 32 ranks = 7)") == ["7.3"]
    assert cited_sections(f"({doc} 3.1 step 9)") == ["3.1"]
    assert cited_sections(f'({doc} 12, "ddp-bench")') == ["12"]
    assert cited_sections(f"(the order of {doc}\n    3.15).") == ["3.15"]
    assert cited_sections(f"({doc}, the 0.7.0 source excerpts)") == []
    assert cited_sections(f"[{doc} 5.6](../reference/{doc}#s5-6)") == ["5.6"]


def test_a_missing_section_fails() -> None:
    doc = "algorithms" + ".md"
    page = "## 5. Dispatch { #s5 }\n### 5.6 Folding { #s5-6 }\n```\n### 9.9 in a fence\n```\n"
    known = set(headings(page))
    assert known == {"5", "5.6"}
    assert unresolved({"a.py:1": cited_sections(f"{doc} 5.6, 5")}, known) == []
    assert unresolved({"a.py:1": cited_sections(f"{doc} 5.6-5.7")}, known) == [f"a.py:1: {doc} 5.7"]
    assert unresolved({"b.md:3": cited_sections(f"{doc} 9.9")}, known) == [f"b.md:3: {doc} 9.9"]
