"""A backend written outside coci, registered for its URL scheme, works end to end with the
manager, and the engine uses no capability the backend did not declare."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.errors import ConfigError, StorageError
from coci_core.storage import LocalStorage, Storage, open_storage, register_storage, registry
from tests.storage.contract import StorageContract


class DictStorage(Storage):
    """Files in a dict; only the required operations (every optional capability keeps the
    Storage default). Records every attribute looked up that the class does not have."""

    renames = True

    def __init__(self, url: str, **options: Any) -> None:
        self.asked: list[str] = []
        self.url = url
        self.options = options
        self.files: dict[str, bytes] = {}
        self.removed: list[str] = []
        self.reads: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and name != "asked":
            self.asked.append(name)
        raise AttributeError(name)

    def list_dir(self, path: str = "") -> list[str]:
        prefix = f"{path}/" if path else ""
        with self._lock:
            names = {k[len(prefix) :].split("/")[0] for k in self.files if k.startswith(prefix)}
        return sorted(names)

    def exists(self, path: str) -> bool:
        with self._lock:
            return path in self.files or any(k.startswith(f"{path}/") for k in self.files)

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        data = b"".join(bytes(chunk) for chunk in chunks)
        with self._lock:
            self.files[path] = data
        return len(data)

    def read_bytes(self, path: str) -> bytes:
        with self._lock:
            if path not in self.files:
                raise StorageError(f"{self.url}/{path} does not exist")
            return self.files[path]

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.reads.append(path)
        view = out.cast("B")
        data = self.read_bytes(path)[offset : offset + len(view)]
        if len(data) < len(view):
            raise StorageError(f"{self.url}/{path} is shorter than expected")
        view[:] = data

    def remove_dir(self, path: str) -> None:
        with self._lock:
            self.removed.append(path)
            for k in [k for k in self.files if k.startswith(f"{path}/")]:
                del self.files[k]

    def publish(self, staging: str, final: str) -> None:
        with self._lock:
            for k in [k for k in self.files if k.startswith(f"{final}/")]:
                del self.files[k]
            for k in [k for k in self.files if k.startswith(f"{staging}/")]:
                self.files[final + k[len(staging) :]] = self.files.pop(k)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[DictStorage]:
    """Registers ``dict://`` for this test; the storages it opened (one per URL: a URL opened
    again is the same store)."""
    monkeypatch.setattr(registry, "_FACTORIES", {})
    made: list[DictStorage] = []

    def factory(url: str, **options: Any) -> DictStorage:
        for storage in made:
            if storage.url == url:
                return storage
        made.append(DictStorage(url, **options))
        return made[-1]

    register_storage("dict", factory)
    return made


class TestDictStorage(StorageContract):
    @pytest.fixture
    def storage(self) -> Storage:
        return DictStorage("dict://contract")


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_a_registered_backend_saves_retires_and_restores(
    opened: list[DictStorage], compression: str
) -> None:
    """Saved through the manager, old steps retired by deletion (the default ``retire``),
    restored newest first and by step, every array read with ``read_into``; the engine looked
    up nothing the backend does not have."""
    states = {step: {"w": torch.randn(64, 8) + step, "step": step} for step in range(1, 5)}
    with CheckpointManager("dict://run", keep_last=2, compression=compression) as mgr:
        for step, state in states.items():
            mgr.save(step, state).wait()
        kept = mgr.steps()  # with deltas, also the base they need
    assert kept[-2:] == [3, 4] and len(kept) < 4
    (storage,) = opened
    assert isinstance(storage, DictStorage) and storage.url == "dict://run"
    assert {f"step-{s:010d}" for s in states if s not in kept} <= set(storage.removed)
    with CheckpointManager("dict://run") as mgr:
        restored = mgr.restore()
        assert restored["step"] == 4 and torch.equal(restored["w"], states[4]["w"])
        older = mgr.restore(step=3)
        assert older["step"] == 3 and torch.equal(older["w"], states[3]["w"])
    assert any("/data-" in path for path in storage.reads), storage.reads
    assert not storage.asked


def test_storage_options_reach_the_factory(opened: list[DictStorage]) -> None:
    storage = open_storage("DICT://x", region="here")
    assert storage is opened[0] and opened[0].options == {"region": "here"}


def test_other_schemes_and_paths_are_not_taken(opened: list[DictStorage], tmp_path: Any) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert not isinstance(open_storage("memory://coci-registry"), DictStorage)
    assert not opened


@pytest.mark.parametrize("scheme", ["", "dict://", "1dict", "di ct", None])
def test_a_scheme_is_checked(scheme: Any) -> None:
    with pytest.raises(ConfigError, match="not a URL scheme"):
        register_storage(scheme, DictStorage)


def test_a_factory_is_checked() -> None:
    with pytest.raises(ConfigError, match="not callable"):
        register_storage("dict", "DictStorage")  # type: ignore[arg-type]
