"""MkDocs hooks (mkdocs.yml ``hooks:``): the config reference's table, generated at build time.

``docs/config.md`` holds the marker below; the build puts ``hpcdl.config.markdown_table()`` in
its place, so the table is the components' declared schemas and cannot drift from them.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- generated: hpcdl.config.markdown_table() -->"


def config_page(markdown: str) -> str:
    """``markdown`` with the marker replaced by the table of config keys (exactly one marker)."""
    from hpcdl.config import markdown_table

    if markdown.count(MARKER) != 1:
        raise ValueError(f"docs/config.md must hold the marker {MARKER!r} exactly once")
    return markdown.replace(MARKER, markdown_table())


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' hook: fill in the config reference's table."""
    return config_page(markdown) if page.file.src_uri == "config.md" else markdown
