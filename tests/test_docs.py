"""The README stays a front page and the docs stay readable as rendered markdown.

Why: README.md grew to 475 lines, with a timing log by the hour in its set-up section and a
config table cell of ~1,900 characters, and docs/config.md had cells of 1,400-1,900
characters (issue 59). A newcomer should find the two commands at the top, and a table
cell should be a cell, not a page: long explanations go in paragraphs or lists under the
table. Links between the docs are checked because sections move between files.

Pure file reading: no daemon, no torch.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

MAX_README_LINES = 250
COMMANDS_WITHIN = 30
MAX_CELL = 400

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details to docs/")


@pytest.mark.parametrize("command", ["scripts/start.sh", "scripts/test.sh"])
def test_readme_starts_with_the_two_commands(command):
    head = "\n".join(README.read_text(encoding="utf-8").splitlines()[:COMMANDS_WITHIN])
    assert command in head, f"{command} is not in README.md's first {COMMANDS_WITHIN} lines"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_table_cells_are_short(page):
    long = []
    for number, line in _prose(page):
        if not line.lstrip().startswith("|"):
            continue
        for cell in CELL_SPLIT.split(line.strip().strip("|")):
            if len(cell.strip()) > MAX_CELL:
                long.append(f"{_rel(page)}:{number}: a cell of {len(cell.strip())} characters "
                            f"({cell.strip()[:60]}...)")
    assert not long, (f"table cells over {MAX_CELL} characters (put the detail in a list or "
                      "paragraph under the table):\n" + "\n".join(long))


@lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats
    numbered; plus explicit ``<a id=...>`` / ``<a name=...>`` anchors."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path):
        for m in re.finditer(r"<a\s+(?:id|name)=\"([^\"]+)\"", line):
            out.add(m.group(1))
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))   # link text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for number, line in _prose(page):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):     # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{_rel(page)}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(page)}:{number}: {target} (no heading #{anchor})")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
