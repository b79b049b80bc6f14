"""The writer writes the arena chunk by chunk as it is copied, checksumming piece by piece."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import crc32c
import pytest
import torch

from coci_core import BackgroundSaveError, CheckpointManager, LocalStorage
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.save import persist
from tests.harness.states import assert_same

CHUNK = 8192


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "empty_first": torch.zeros(0),
        "small": torch.randn(3, generator=g),
        "spans_chunks": torch.randn(5000, generator=g),  # 20 KB over three 8 KB chunks
        "flags": torch.rand(5, generator=g) > 0.5,
        "half": torch.randn(4097, generator=g).half(),
        "ends_on_chunk": torch.randn(CHUNK // 4, generator=g),
        "step": 7,
        "empty_last": torch.zeros(0, 3),
    }


def test_pieces_across_write_chunks_round_trip_and_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checksums computed chunk by chunk equal those of the stored bytes; a flipped byte in a
    piece that spans chunks is found."""
    monkeypatch.setattr(persist, "WRITE_CHUNK_BYTES", CHUNK)
    state = _state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
        assert mgr.verify() == {1: []}
        assert_same(mgr.restore(), state)
        manifest = mgr.manifest(1)
    data = (tmp_path / step_dir_name(1) / "data-r0.bin").read_bytes()
    pieces = {e.key: e.pieces for e in manifest.tensors}
    for key, entry_pieces in pieces.items():
        for p in entry_pieces:
            assert p.crc32c == crc32c.crc32c(data[p.offset : p.offset + p.nbytes]), key
    (span,) = pieces["/spans_chunks"]
    assert span.offset // CHUNK != (span.offset + span.nbytes - 1) // CHUNK
    damaged = bytearray(data)
    damaged[span.offset + span.nbytes - 10] ^= 1  # in its last chunk
    (tmp_path / step_dir_name(1) / "data-r0.bin").write_bytes(bytes(damaged))
    with CheckpointManager(tmp_path) as mgr:
        (bad,) = mgr.verify()[1]
        assert "spans_chunks" in str(bad)


class _FailAfterFirstChunk(LocalStorage):
    """Takes one chunk of a data file, then fails like a full disk."""

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.endswith(".bin"):
            for _ in chunks:
                raise OSError(28, "No space left on device")
        return super().write_file(path, chunks, aligned=aligned)


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_failed_write_stops_the_helpers_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """A write that fails mid-file surfaces, commits nothing and leaves no helper thread
    (the raw path's checksum thread, the encoded path's read-ahead)."""
    monkeypatch.setattr(persist, "WRITE_CHUNK_BYTES", CHUNK)
    state = _state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
    with CheckpointManager(_FailAfterFirstChunk(tmp_path), compression=compression) as mgr:
        # many chunks or pieces: the helpers are mid-stream when the write fails
        big = {f"w{i}": torch.randn(4 * CHUNK) for i in range(8)}
        with pytest.raises(BackgroundSaveError, match="No space left"):
            mgr.save(2, big).wait()
        helpers = [t.name for t in threading.enumerate() if t.name.startswith("coci-persist-")]
        assert not helpers
        assert mgr.steps() == [1]
        assert_same(mgr.restore(), state)
