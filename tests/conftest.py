"""Hygiene for every test: no leaked coci writer threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.harness.s3 import S3Server, start_s3_server

_WRITER_THREADS = (
    "coci-persist",
    "coci-persist-ahead",
    "coci-telemetry",
    "coci-telemetry-put",
    "coci-lease",
)


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS on loopback), started once per session when a test asks."""
    server = start_s3_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_prefix(s3_server: S3Server) -> str:
    """``bucket/prefix``: a fresh, empty prefix on the session's S3 server."""
    return s3_server.fresh_prefix()
