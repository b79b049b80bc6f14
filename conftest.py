"""The Python blocks of README.md and docs/*.md run as tests, with pytest-markdown-docs.

The plugin's ``--markdown-docs`` would also search the docstrings of every test module for
blocks; here only the Markdown files are collected (``testpaths`` names them), each Python
block one test. A block's info string names what it needs (``python fixture:model``) and
marks the few that cannot run (``python notest``, with the reason beside the block); the
fixtures are in :mod:`tests.docs_blocks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pytest_markdown_docs.plugin import MarkdownTextFile

ROOT = Path(__file__).resolve().parent
DOCUMENTS = (ROOT / "README.md", ROOT / "docs")

pytest_plugins = ["tests.docs_blocks"]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Any:
    if file_path.suffix != ".md" or parent.config.option.markdowndocs:
        return None  # with --markdown-docs the plugin collects the Markdown files itself
    if file_path == DOCUMENTS[0] or file_path.parent == DOCUMENTS[1]:
        return MarkdownTextFile.from_parent(parent, path=file_path)
    return None
