"""The documentation's shape: a README a newcomer reads through (at most 200 lines, none over 120
characters), every page under docs/ reachable from docs/index.md, and no relative link in the
README or docs/ that points at a file that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images in ``text``, code left out."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", text)))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("#")


def broken(page: Path, base: Path = ROOT) -> list[str]:
    out = []
    for target in links(page.read_text()):
        if not relative(target):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            out.append(f"{page.relative_to(base)}: {target}")
    return out


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_readme_is_short_and_narrow():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    assert [f"{n}: {len(line)}" for n, line in enumerate(lines, 1) if len(line) > 120] == []


def test_every_page_under_docs_is_linked_from_the_index():
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in links(INDEX.read_text()) if relative(t)}
    assert [str(p.relative_to(DOCS)) for p in pages() if p != INDEX and p.resolve() not in linked] == []


def test_every_relative_link_points_at_a_file():
    assert [b for page in [README, *pages()] for b in broken(page)] == []


def test_the_link_reader_sees_links_and_images_but_not_code(tmp_path):
    text = ("see [a](a.md), ![img](pics/b.png \"title\"), [web](https://x.org/c.md), [here](#top)\n"
            "`[not](code.md)` and\n```\n[nor](fenced.md)\n```\n[d](sub/d.md#part)\n")
    assert links(text) == ["a.md", "pics/b.png", "https://x.org/c.md", "#top", "sub/d.md#part"]
    page = tmp_path / "p.md"
    page.write_text(text)
    (tmp_path / "a.md").write_text("")
    assert [t for t in links(text) if relative(t)] == ["a.md", "pics/b.png", "sub/d.md#part"]
    assert broken(page, tmp_path) == ["p.md: pics/b.png", "p.md: sub/d.md#part"]

