"""Hygiene for every test: no leaked coci writer threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

_WRITER_THREADS = ("coci-persist", "coci-persist-ahead", "coci-telemetry")


@pytest.fixture(autouse=True)
def _no_leaked_writer_threads() -> Iterator[None]:
    """A test that leaves a coci writer thread running (an unclosed manager) fails."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name in _WRITER_THREADS and t.is_alive()
    ]
    assert not leaked, f"writer threads left running (close the CheckpointManager): {leaked}"
