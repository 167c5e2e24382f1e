"""The README and docs/ as a reader meets them: every link resolves inside the repository (file
and heading), the first screen shows the two commands and the page, and the words an operator
searches for are findable."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def prose(path: Path) -> str:
    """The text outside code blocks and code spans, where links are links."""
    return CODE.sub("", FENCE.sub("", path.read_text()))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M)
    return {slug(h) for h in headings}


def test_every_link_resolves_inside_the_repository() -> None:
    broken = []
    for doc in DOCS:
        for match in LINK.finditer(prose(doc)):
            target = match.group(1) or match.group(2)
            where = f"{doc.relative_to(ROOT)}: {target}"
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                broken.append(f"{where} (points outside the repository)")
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (doc.parent / path_part).resolve() if path_part else doc
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{where} (no such file in the repository)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading #{anchor})")
    assert broken == [], "\n".join(broken)
    assert sum(len(LINK.findall(prose(d))) for d in DOCS) > 30  # the check saw the links


def test_the_first_screen_has_the_two_commands_and_the_page() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    for needed in ("make run", "make test", "kiln api", "kiln worker", "?token="):
        assert needed in first, needed
    assert "## Contents" in (ROOT / "README.md").read_text()


def test_the_readme_is_a_guide_and_the_reference_lives_in_docs() -> None:
    # A newcomer needed its first 120 lines and the route table; the rest is reference (issue 40).
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    for page in ("requests", "http", "workers", "manifests", "results", "fleet", "benchmarks"):
        assert f"](docs/{page}.md)" in readme, page


def test_an_operators_words_are_findable() -> None:
    text = "\n".join(d.read_text() for d in DOCS)
    for word in (
        "KILN_FAULTS",
        "Sentinel",
        "pickle",
        "rq info",
        "recompile",
        "min_vram_gb",
        "Prometheus",
        "kiln top",
        "KILN_API_ORIGINS",
        "Idempotency-Key",
    ):
        assert word in text, word
