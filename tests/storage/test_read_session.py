"""LocalStorage's read sessions: one descriptor per file lent for a restore's reads, never one
of a file the path no longer names, never closed under a read that holds it, at most
SESSION_DESCRIPTORS of them, and nothing of a parent's session in a forked child."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from coci_core.storage import LocalStorage
from coci_core.storage import local as local_module


def _read(storage: LocalStorage, name: str, n: int) -> bytes:
    out = bytearray(n)
    storage.read_into(name, 0, memoryview(out))
    return bytes(out)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_one_descriptor_per_file_and_never_a_stale_one(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"first" * 100)
    storage = LocalStorage(tmp_path)
    with storage.read_session():
        assert _read(storage, "a", 500) == b"first" * 100
        assert _read(storage, "a", 500) == b"first" * 100
        (lent,) = storage._read_fds.values()
        first_fd = lent.fd
        # the step is saved again: the path names another file, which the next read sees
        (tmp_path / "a.new").write_bytes(b"again" * 100)
        os.replace(tmp_path / "a.new", tmp_path / "a")
        assert _read(storage, "a", 500) == b"again" * 100
        (lent,) = storage._read_fds.values()
        assert not _is_open(first_fd) or first_fd == lent.fd  # the old one closed (or reused)
        last_fd = lent.fd
    assert storage._read_fds == {}
    assert not _is_open(last_fd)
    assert _read(storage, "a", 500) == b"again" * 100  # outside a session: a descriptor a read


def test_a_descriptor_held_by_a_read_outlives_its_session(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 4096)
    storage = LocalStorage(tmp_path)
    with storage.read_session():
        fd, done, _ = storage._open_read(tmp_path / "a")
    assert _is_open(fd)  # a read still holds it: not closed under it
    assert os.pread(fd, 4, 0) == b"xxxx"
    done()
    assert not _is_open(fd)


def test_at_most_session_descriptors_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "SESSION_DESCRIPTORS", 2)
    for i in range(4):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 64)
    storage = LocalStorage(tmp_path)
    with storage.read_session():
        for _ in range(2):
            assert [_read(storage, f"f{i}", 64) for i in range(4)] == [
                bytes([i]) * 64 for i in range(4)
            ]
        assert len(storage._read_fds) == 2


def _child_read(root: str) -> bytes:
    storage = _SHARED[root]
    with storage.read_session():
        return _read(storage, "a", 64)


_SHARED: dict[str, LocalStorage] = {}


def test_a_forked_child_has_none_of_its_parents_session(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"y" * 64)
    storage = _SHARED[str(tmp_path)] = LocalStorage(tmp_path)
    try:
        with storage.read_session():
            assert _read(storage, "a", 64) == b"y" * 64
            with storage._read_lock:  # held by this thread while the child is forked
                ctx = multiprocessing.get_context("fork")
                with ctx.Pool(1) as pool:
                    got = pool.apply_async(_child_read, (str(tmp_path),)).get(60)
            assert got == b"y" * 64
            assert len(storage._read_fds) == 1  # the parent's session is untouched
    finally:
        del _SHARED[str(tmp_path)]
