"""MkDocs hooks (mkdocs.yml ``hooks:``): the config reference's table and the experiments' pages.

``docs/config.md`` holds the marker below; the build puts ``hpcdl.config.markdown_table()`` in
its place, so the table is the components' declared schemas and cannot drift from them.

Each ``jobs/experiments/<name>/README.md`` becomes the page ``experiments/<name>/index.md``,
with the PNGs beside it (so its image links stay as they are and the strict build checks
them); the pages join the nav's "Experiments" section, and ``docs/experiments/index.md``'s
marker becomes the list of them. Nothing is copied into ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = "<!-- generated: hpcdl.config.markdown_table() -->"
EXPERIMENTS_MARKER = "<!-- generated: the experiments' pages -->"
#: the nav section the experiments' pages are appended to (mkdocs.yml)
EXPERIMENTS_NAV = "Experiments"


def config_page(markdown: str) -> str:
    """``markdown`` with the marker replaced by the table of config keys (exactly one marker)."""
    from hpcdl.config import markdown_table

    if markdown.count(MARKER) != 1:
        raise ValueError(f"docs/config.md must hold the marker {MARKER!r} exactly once")
    return markdown.replace(MARKER, markdown_table())


def experiments(root: Path) -> dict[str, Path]:
    """Each experiment's name and its README (``jobs/experiments/<name>/README.md`` under ``root``)."""
    return {p.parent.name: p for p in sorted((root / "jobs" / "experiments").glob("*/README.md"))}


def title(readme: Path) -> str:
    """The first ``# `` heading of ``readme`` (its directory's name when it has none)."""
    found = re.search(r"^# (.+)$", readme.read_text(), re.MULTILINE)
    return found.group(1).strip() if found else readme.parent.name


def experiments_list(root: Path) -> str:
    """The Markdown list of the experiments' pages, as linked from ``experiments/index.md``."""
    return "\n".join(f"* [{title(p)}]({name}/index.md) (`jobs/experiments/{name}/`)"
                     for name, p in experiments(root).items())  # fmt: skip


def _root(config: Any) -> Path:
    return Path(config.docs_dir).resolve().parent


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """MkDocs' hook: add each experiment's README and its figures under ``experiments/<name>/``,
    and their pages to the nav's "Experiments" section."""
    from mkdocs.structure.files import File

    pages = []
    for name, readme in experiments(_root(config)).items():
        src = f"experiments/{name}/index.md"
        files.append(File.generated(config, src, abs_src_path=str(readme)))
        for figure in sorted(readme.parent.glob("*.png")):
            files.append(
                File.generated(config, f"experiments/{name}/{figure.name}", abs_src_path=str(figure))
            )
        pages.append({name: src})
    for entry in config.nav or []:
        if isinstance(entry, dict) and isinstance(entry.get(EXPERIMENTS_NAV), list):
            entry[EXPERIMENTS_NAV].extend(
                p for p in pages if p not in entry[EXPERIMENTS_NAV]
            )  # serve rebuilds
            break
    else:
        raise ValueError(
            f"mkdocs.yml's nav must have a section {EXPERIMENTS_NAV!r} for the experiments' pages"
        )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """MkDocs' hook: fill in the config reference's table and the experiments' list."""
    if page.file.src_uri == "config.md":
        return config_page(markdown)
    if page.file.src_uri == "experiments/index.md":
        return markdown.replace(EXPERIMENTS_MARKER, experiments_list(_root(config)))
    return markdown
