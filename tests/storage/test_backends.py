"""Every storage backend passes the same contract."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coci_core.storage import FsspecStorage, LocalStorage, Storage, open_storage
from tests.storage.contract import StorageContract


class TestLocalStorage(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        return LocalStorage(tmp_path / "root")


class TestLocalStorageBuffered(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        return LocalStorage(tmp_path / "root", direct_io=False)


class TestFsspecMemory(StorageContract):
    @pytest.fixture
    def storage(self) -> Storage:
        return FsspecStorage(f"memory://coci-{uuid.uuid4().hex}")


class TestFsspecFile(StorageContract):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        return FsspecStorage(f"file://{tmp_path}/root")


def test_open_storage_dispatch(tmp_path: Path) -> None:
    """Paths open as LocalStorage, URLs through fsspec, Storage objects as they are."""
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage("memory://x"), FsspecStorage)
    local = LocalStorage(tmp_path)
    assert open_storage(local) is local
