"""Every relative link and image in the README, docs/ and the experiments' READMEs points at a file.

``mkdocs build --strict`` (``make docs``) checks docs/ with anchors; this also covers the
README, which the site does not build, and the experiment READMEs (which the site builds too).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Markdown links and images, ``[text](target)`` and ``![alt](target "title")``
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
#: written in parallel (issue 22): the README and the site link it before it lands
PENDING = {ROOT / "docs" / "design.md"}


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return pages + sorted((ROOT / "jobs" / "experiments").glob("*/README.md"))


def relative_links(text: str) -> list[str]:
    """The relative targets (no URL scheme, no bare ``#anchor``) of ``text``'s links, outside code."""
    text = CODE.sub("", FENCE.sub("", text))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(unquote(target.split("#", 1)[0]))
    return targets


def missing(page: Path) -> list[str]:
    """The relative links of ``page`` whose file does not exist."""
    return [
        t for t in relative_links(page.read_text())
        if not (page.parent / t).exists() and (page.parent / t).resolve() not in PENDING
    ]  # fmt: skip


def test_finds_links_and_images_outside_code() -> None:
    text = '[a](docs/x.md#y) ![b](fig.png "t") [c](https://e.org) [d](#z)\n'
    text += "`[e](no.md)`\n```\n[f](no.md)\n```\n"
    assert relative_links(text) == ["docs/x.md", "fig.png"]


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in _pages()])
def test_every_relative_link_resolves(page: Path) -> None:
    assert missing(page) == [], f"{page.relative_to(ROOT)} links files that do not exist"
