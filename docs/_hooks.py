"""MkDocs hook: render the Sphinx roles of the docstrings (``:class:`~a.B```) as code."""

from __future__ import annotations

import re
from typing import Any

# After Markdown, ":class:`~coci_core.x.Storage`" is ":class:<code>~coci_core.x.Storage</code>".
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>(~?)([^<]+)</code>")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_code, html)
