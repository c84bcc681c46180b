"""docs/results.md, the page a user reads: short, every raw-rows file it names present and every file in docs/data/
named by it, its pictures present and redrawn by ``python -m benchmarks.plots``, and every link or section name
other pages point at it by still there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = DOCS / "results.md"
MAX_LINES = 300
DATA_REF = re.compile(r"docs/data/([A-Za-z0-9_.-]*[A-Za-z0-9])")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
#: A link to the page, with its anchor (``results.md#anchor``), from anywhere.
ANCHOR_LINK = re.compile(r"results\.md#([A-Za-z0-9_-]+)")
#: A section named in words after the page (``docs/results.md``, "Section name").
SECTION_NAME = re.compile(r'results\.md`*\)?,\s+"([^"]+)"')


def page() -> str:
    return PAGE.read_text()


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings() -> list[str]:
    return [line.lstrip("#").strip() for line in page().splitlines() if line.startswith("#")]


def pointing_files() -> list[Path]:
    """Files whose text may point at the page: the docs (not the history, which quotes old pages), the README, the code."""
    files = [ROOT / "README.md", *DOCS.glob("*.md")]
    for package in ("cachegen_core", "langchain_cachegen", "benchmarks", "examples"):
        files += (ROOT / package).rglob("*.py")
    return files


def test_the_page_is_short():
    assert len(page().splitlines()) <= MAX_LINES, "move how a figure was arrived at to docs/history/"


def test_every_data_file_the_page_names_exists():
    missing = sorted({name for name in DATA_REF.findall(page()) if not (DOCS / "data" / name).is_file()})
    assert missing == []


def test_every_file_in_docs_data_is_named_by_the_page():
    named = set(DATA_REF.findall(page()))
    unnamed = sorted(p.name for p in (DOCS / "data").iterdir() if p.name not in named)
    assert unnamed == [], "cite them on the page, or move them under docs/history/data/ with the history that cites them"


def test_the_pictures_the_page_shows_exist_and_are_small():
    images = IMAGE.findall(page())
    assert len(images) >= 3
    for ref in images:
        path = (DOCS / ref).resolve()
        assert path.is_file(), ref
        assert path.parent == DOCS / "img", f"{ref}: the page's pictures live in docs/img/"
        assert path.stat().st_size < 100_000, f"{ref}: {path.stat().st_size} bytes"


def test_links_and_section_names_pointing_at_the_page_resolve():
    anchors = {slug(h) for h in headings()}
    names = set(headings())
    bad = []
    for f in pointing_files():
        text = f.read_text()
        bad += [f"{f.relative_to(ROOT)}: #{a}" for a in ANCHOR_LINK.findall(text) if a not in anchors]
        bad += [f'{f.relative_to(ROOT)}: "{n}"' for n in SECTION_NAME.findall(text) if n not in names]
    bad += [f"results.md: #{a}" for a in re.findall(r"\]\(#([A-Za-z0-9_-]+)\)", page()) if a not in anchors]
    assert bad == []


def test_benchmarks_plots_redraws_the_pages_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    plots.main(["--data", str(DOCS / "data"), "--out", str(tmp_path)])
    shown = {Path(ref).name for ref in IMAGE.findall(page())}
    drawn = {p.name for p in tmp_path.iterdir()}
    assert shown == drawn
    for p in tmp_path.iterdir():
        assert p.read_bytes().startswith(b"\x89PNG") and 5_000 < p.stat().st_size < 100_000, p.name
