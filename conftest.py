"""The Python blocks of README.md and docs/*.md run as tests, with pytest-markdown-docs.

The plugin's ``--markdown-docs`` would also search the docstrings of every test module for
blocks; here only the Markdown files are collected (``testpaths`` names them), each Python
block one test. A block's info string names what it needs (``python fixture:model``) and
marks the few that cannot run (``python notest``, with the reason beside the block); the
fixtures are in :mod:`tests.docs_blocks`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_markdown_docs.plugin import MarkdownTextFile

ROOT = Path(__file__).resolve().parent
DOCUMENTS = (ROOT / "README.md", ROOT / "docs")

pytest_plugins = ["tests.docs_blocks"]

# Every connection to torch's TCPStore (a rank's init_process_group, a manager's pulse and
# watch clones) names its peer with getnameinfo; ::ffff:127.0.0.1 is not in /etc/hosts, so
# glibc asks DNS for its PTR record. Where the DNS server drops a query now and then (about 1
# in 40 in the CI sandbox), that connection waited glibc's 5 s timeout before it retried: 5 s
# stalls at random in every multi-rank test (25 s of the rank agreement test's 55 s). A lost
# answer is retried after 1 s instead, in pytest and in every child it starts; a value already
# set is kept.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:4")


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """A test (or a library it starts, like Ray) that installs a SIGTERM or SIGINT handler
    does not leave it to the tests after it: the preemption tests chain to what is there."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Any:
    if file_path.suffix != ".md" or parent.config.option.markdowndocs:
        return None  # with --markdown-docs the plugin collects the Markdown files itself
    if file_path == DOCUMENTS[0] or file_path.parent == DOCUMENTS[1]:
        return MarkdownTextFile.from_parent(parent, path=file_path)
    return None
