"""Reads only regular files: a FIFO, a device (a symlink to /dev/zero) or a directory where a
checkpoint file should be is refused at once, on local storage and on fsspec's local file
system (a FIFO used to hang restore, /dev/zero to be read until memory ran out)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from coci_core import StorageError
from coci_core.storage import FsspecStorage, LocalStorage, Storage

pytestmark = pytest.mark.timeout(30)

BACKENDS: dict[str, Callable[[Path], Storage]] = {
    "local": lambda root: LocalStorage(root),
    "local-buffered": lambda root: LocalStorage(root, direct_io=False),
    "fsspec-file": lambda root: FsspecStorage(f"file://{root}"),
}


@pytest.fixture(params=sorted(BACKENDS))
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "file").write_bytes(b"0123456789")
    os.mkfifo(root / "d" / "fifo")
    (root / "d" / "zero").symlink_to("/dev/zero")
    (root / "d" / "dir").mkdir()
    return BACKENDS[request.param](root)


def test_size_and_reads_of_a_regular_file(storage: Storage) -> None:
    assert storage.size("d/file") == 10  # type: ignore[attr-defined]
    assert storage.read_bytes("d/file") == b"0123456789"
    out = bytearray(4)
    storage.read_into("d/file", 3, memoryview(out))
    assert out == b"3456"
    with pytest.raises(StorageError, match="shorter"):
        storage.read_into("d/file", 8, memoryview(bytearray(4)))
    with pytest.raises(StorageError):
        storage.size("d/missing")  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["fifo", "zero", "dir"])
def test_files_that_are_not_regular_are_refused(storage: Storage, name: str) -> None:
    path = f"d/{name}"
    with pytest.raises(StorageError, match="regular file"):
        storage.size(path)  # type: ignore[attr-defined]
    with pytest.raises(StorageError):
        storage.read_bytes(path)
    with pytest.raises(StorageError):
        storage.read_into(path, 0, memoryview(bytearray(16)))


def test_memory_file_system_sizes() -> None:
    storage = FsspecStorage(f"memory://coci-{uuid.uuid4().hex}")
    storage.write_file("d/file", [memoryview(b"abc")])
    assert storage.size("d/file") == 3
    with pytest.raises(StorageError):
        storage.size("d/missing")
    with pytest.raises(StorageError):
        storage.size("d")  # a directory
