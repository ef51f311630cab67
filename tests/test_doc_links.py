"""Every relative link of README.md and docs/*.md leads to an existing file, and to an existing
heading when it names one (``page.md#anchor``, anchors as GitHub makes them). Pure: reads files.

Links to other sites are not followed. ``PENDING`` names the pages other work adds; a link to one
of them passes while it is absent and is checked like any other once it exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PENDING = {"docs/benchmarks.md", "docs/expert_parallel.md", "docs/plan.md", "docs/explain.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(text: str) -> str:
    """The page without its fenced blocks (code may contain ``[x](y)`` that is not a link)."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(text), re.M):
        plain = re.sub(r"[`*]", "", heading).strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", plain).replace(" ", "-"))
    return out


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        name = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
        if not dest.exists():
            if name not in PENDING:
                broken.append(f"{target} (no file {name})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_the_front_page_links_every_guide():
    """Where next: every page under docs/ (and each pending one) is in the front page's contents."""
    linked = {(REPO / t.partition("#")[0]).resolve().relative_to(REPO).as_posix() for t in _links(REPO / "README.md")
              if t.partition("#")[0]}
    guides = {p.relative_to(REPO).as_posix() for p in PAGES[1:]} | PENDING
    assert not guides - linked, f"README.md does not link these guides: {sorted(guides - linked)}"


def test_the_anchor_rule():
    assert anchors("## Data parallelism: fully_shard (FSDP2) and replicate (DDP)\n") == {
        "data-parallelism-fully_shard-fsdp2-and-replicate-ddp"}
    assert anchors("## Compiling: torch.compile\n## The trainer: --resume in another layout\n") == {
        "compiling-torchcompile", "the-trainer---resume-in-another-layout"}
