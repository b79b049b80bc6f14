"""Storage wrappers that fail or hold at chosen calls, for fault-injection tests."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from coci_core.engine.directory.steps import read_manifest
from coci_core.engine.format.manifest import step_dir_name
from coci_core.knobs import S3_PART_BYTES, MiB
from coci_core.storage import LocalStorage, Storage, StorageWrapper, s3_parallel


def flip_stored_byte(
    directory: Path, step: int, rank: int, key: str | None = None, *, own: bool = False
) -> str:
    """Flip one byte of what ``rank`` wrote of ``key`` (default: its first array) at ``step``
    of the local checkpoint ``directory``: of the shared state, or with ``own`` of that rank's
    own state (``per_rank``). Disk damage only that rank reads. Returns the key."""
    manifest = read_manifest(LocalStorage(directory), step)
    entries = manifest.per_rank[rank].tensors if own else manifest.tensors
    file = f"data-r{rank}.bin"
    entry = next(
        e
        for e in entries
        if (key is None or e.key == key) and any(p.file == file and p.nbytes for p in e.pieces)
    )
    piece = next(p for p in entry.pieces if p.file == file and p.nbytes)
    path = directory / step_dir_name(step) / file
    data = bytearray(path.read_bytes())
    data[piece.offset + piece.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return entry.key


class FaultyStorage(StorageWrapper):
    """Delegates to ``inner`` but raises ``error`` on the listed calls of each operation.

    ``fail={"write_file": [1], "publish": [0]}`` fails the second ``write_file`` and the first
    ``publish`` (calls are counted from 0 per operation).
    """

    def __init__(
        self,
        inner: Storage,
        fail: Mapping[str, Sequence[int]],
        error: OSError | None = None,
    ) -> None:
        super().__init__(inner)
        self.fail = {op: set(calls) for op, calls in fail.items()}
        self.error = error or OSError(errno.ENOSPC, "No space left on device")
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, op: str) -> None:
        n = self.calls.get(op, 0)
        self.calls[op] = n + 1
        if n in self.fail.get(op, ()):
            raise self.error

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        self._maybe_fail("write_file")
        return self.inner.write_file(path, chunks, aligned=aligned)

    def publish(self, staging: str, final: str) -> None:
        self._maybe_fail("publish")
        self.inner.publish(staging, final)


class HeldStorage(FaultyStorage):
    """Holds every ``write_file`` until ``release`` is set; ``entered`` is set when one waits."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner, fail={})
        self.release = threading.Event()
        self.entered = threading.Event()

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        self.entered.set()
        self.release.wait()
        return self.inner.write_file(path, chunks, aligned=aligned)


def hold_s3_uploads(match: str, parts: int, on_hold: Callable[[], None]) -> None:
    """Patch :func:`s3_parallel.upload` (in this process) so that an upload of a path
    containing ``match`` calls ``on_hold`` once its first ``parts`` parts have been handed to
    the upload (the multipart upload is then open on the server), before the rest is read.

    The caller's chunks are passed on in pieces of 1 MiB, so that the upload asks for more
    after each part whatever size the chunks are.
    """
    real = s3_parallel.upload

    def upload(fs: Any, path: str, chunks: Iterable[memoryview], **kw: Any) -> int:
        if match not in path:
            return real(fs, path, chunks, **kw)
        limit = parts * kw.get("part_bytes", S3_PART_BYTES)

        def pieces() -> Iterator[memoryview]:
            sent = 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), MiB):
                    if sent >= limit:
                        on_hold()
                    piece = view[start : start + MiB]
                    sent += len(piece)
                    yield piece

        return real(fs, path, pieces(), **kw)

    s3_parallel.upload = upload  # type: ignore[assignment]
