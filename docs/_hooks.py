"""MkDocs hooks: a Python block's test options (``python fixture:model``, ``python notest``,
read by pytest-markdown-docs) are not shown, and the Sphinx roles of the docstrings
(``:class:`~a.B```) are rendered as code."""

from __future__ import annotations

import re
from typing import Any

# After Markdown, ":class:`~coci_core.x.Storage`" is ":class:<code>~coci_core.x.Storage</code>".
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>(~?)([^<]+)</code>")


# The opening fence of a Python block with options after the language: SuperFences would not
# take it for a fence at all.
_FENCE_OPTIONS = re.compile(r"^([ \t]*(?:`{3,}|~{3,})(?:python|py|python3))[ \t]+[^`\n]*$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _FENCE_OPTIONS.sub(r"\1", markdown)


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_code, html)
