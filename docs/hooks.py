"""mkdocs hooks (``mkdocs.yml``): the reference pages' tables, made at build time from
the code (``serving.reference``), so that they cannot drift from it."""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if "<!-- reference:" not in markdown:
        return markdown
    from serving import reference as ref

    tables = {
        "serve-flags": lambda: ref.table(
            ref.serve_flags(), ["flag", "takes", "default", "what it does"]
        ),
        "toml-keys": lambda: ref.table(
            ref.toml_keys(), ["key", "takes", "default", "sections", "Triton", "what it does"]
        ),
        "metrics": lambda: ref.table(ref.metric_families(), ["metric", "type", "labels", "help"]),
    }
    for name, make in tables.items():
        marker = f"<!-- reference: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
