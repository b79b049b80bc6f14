"""The contract every Storage backend must pass; a backend's test overrides ``storage``."""

from __future__ import annotations

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.storage import Storage, staging_name


class StorageContract:
    """Round trip, listing, range reads, commit visibility and cleanup of partial writes."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError

    def test_write_read_and_ranges(self, storage: Storage) -> None:
        """Written bytes read back whole and by range; listing shows the file."""
        n = storage.write_file("d/f.bin", [memoryview(b"hello "), memoryview(b"world")])
        assert n == 11
        assert storage.read_bytes("d/f.bin") == b"hello world"
        out = bytearray(5)
        storage.read_into("d/f.bin", 6, memoryview(out))
        assert bytes(out) == b"world"
        assert storage.list_dir("d") == ["f.bin"]
        assert storage.exists("d/f.bin")
        assert not storage.exists("d/g.bin")
        assert storage.list_dir("nowhere") == []

    def test_short_read_raises(self, storage: Storage) -> None:
        """Reading past the end is an error, not a silently short buffer."""
        storage.write_file("f.bin", [memoryview(b"abc")])
        with pytest.raises(OSError, match="shorter"):
            storage.read_into("f.bin", 1, memoryview(bytearray(5)))

    def test_the_staging_directory_is_named_by_the_engine(self, storage: Storage) -> None:
        """A save stages under the name the cleanup of partial writes looks for (or in place,
        without renames)."""
        staged = storage.staging_dir("step-0000000001", "tok")
        assert staged == (
            staging_name("step-0000000001", "tok") if storage.renames else "step-0000000001"
        )

    def test_publish_makes_visible(self, storage: Storage) -> None:
        """A staged directory is visible under its final name only after publish."""
        staging = storage.staging_dir("step-0000000001", "tok")
        storage.write_file(f"{staging}/data", [memoryview(b"x")])
        storage.publish(staging, "step-0000000001")
        assert storage.read_bytes("step-0000000001/data") == b"x"
        storage.remove_dir("step-0000000001")
        assert not storage.exists("step-0000000001")

    def test_manager_ignores_and_cleans_partial_writes(self, storage: Storage) -> None:
        """A step without a manifest is not listed and is removed by the next manager."""
        staging = storage.staging_dir("step-0000000009", "tok")
        storage.write_file(f"{staging}/data-r0.bin", [memoryview(b"partial")])
        with CheckpointManager(storage) as mgr:
            assert mgr.steps() == []
            mgr.save(10, {"w": torch.arange(5)}).wait()
            assert mgr.steps() == [10]
            assert torch.equal(mgr.restore()["w"], torch.arange(5))
        assert [n for n in storage.list_dir("") if n.startswith("step-")] == ["step-0000000010"]
