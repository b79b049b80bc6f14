"""Phase 2: checksum, write and commit a snapshot, in one background worker thread.

The data file is the snapshot's arena written as it is (large sequential writes from the reused
buffer, direct I/O where the file system allows), then the manifest, then the atomic publish.
Nothing here pickles, and nothing runs on the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c

from coci_core.codecs import RawCodec
from coci_core.manifest import MANIFEST_NAME, DataFile, Manifest, TensorEntry, step_dir_name
from coci_core.snapshot import Snapshot
from coci_core.storage import Storage
from coci_core.tree import encode_dtype

__all__ = ["LatestOnlyWorker", "PersistJob", "PersistWorker", "WriteResult", "write_checkpoint"]

logger = logging.getLogger(__name__)

WRITE_CHUNK_BYTES = 64 * 1024 * 1024
DATA_FILE = "data-r0.bin"


@dataclass
class PersistJob:
    """One snapshot to make durable."""

    step: int
    snapshot: Snapshot
    tree: Any
    metadata: dict[str, Any]
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class WriteResult:
    """A committed checkpoint: where, its manifest, and how many bytes were written."""

    path: str
    manifest: Manifest
    bytes_written: int


def _chunks(snap: Snapshot) -> Iterator[memoryview]:
    total = snap.arena.total_bytes
    for start in range(0, total, WRITE_CHUNK_BYTES):
        yield snap.arena.memoryview(start, min(start + WRITE_CHUNK_BYTES, total))


def write_checkpoint(storage: Storage, job: PersistJob) -> WriteResult:
    """Checksum the snapshot, write data then manifest, and publish; clean up on failure."""
    snap = job.snapshot
    snap.wait_copied()
    codec = RawCodec()
    entries = []
    for leaf, slot in zip(snap.leaves, snap.slots, strict=True):
        stored = codec.encode(snap.arena.memoryview(slot.offset, slot.offset + slot.nbytes))
        entries.append(
            TensorEntry(
                key=leaf.key,
                kind=leaf.kind,
                dtype=encode_dtype(slot.dtype),
                shape=slot.shape,
                file=DATA_FILE,
                offset=slot.offset,
                nbytes=slot.nbytes,
                codec=codec.descriptor(),
                crc32c=crc32c.crc32c(stored),
                numpy_dtype=leaf.numpy_dtype,
            )
        )
    final = step_dir_name(job.step)
    staging = storage.staging_dir(final, job.token)
    try:
        data_bytes = storage.write_file(f"{staging}/{DATA_FILE}", _chunks(snap), aligned=True)
        manifest = Manifest(
            step=job.step,
            created_unix=time.time(),
            tree=job.tree,
            tensors=tuple(entries),
            files=(DataFile(DATA_FILE, data_bytes),),
            metadata=job.metadata,
        )
        manifest_json = manifest.to_json()
        storage.write_file(f"{staging}/{MANIFEST_NAME}", [memoryview(manifest_json)])
        storage.publish(staging, final)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.remove_dir(staging)
        raise
    return WriteResult(final, manifest, data_bytes + len(manifest_json))


def _lower_thread_priority(niceness: int) -> None:
    # Linux applies nice values per thread: the writer yields the cores to training.
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


class PersistWorker:
    """A single background thread that runs jobs in order (one persist in flight at a time)."""

    def __init__(self, run: Callable[[Any], None], *, niceness: int = 5) -> None:
        self._run = run
        self._niceness = niceness
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Any) -> None:
        """Queue ``job``; starts the thread on first use."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="coci-persist", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        _lower_thread_priority(self._niceness)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:  # the job reports its own errors; never let the worker die
                logger.exception("coci: unexpected error in the writer thread")

    def stop(self) -> None:
        """Finish the queued jobs and end the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()


class LatestOnlyWorker:
    """A background thread that runs ``fn(*args)`` for the newest submission only: work that
    is superseded before it starts (an older plan's telemetry) is dropped."""

    def __init__(self, fn: Callable[..., None], *, name: str, niceness: int = 5) -> None:
        self._fn = fn
        self._name = name
        self._niceness = niceness
        self._pending: tuple[Any, ...] | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, *args: Any) -> None:
        """Replace any pending work with ``args``."""
        with self._cond:
            if self._stopping:
                return
            self._pending = args
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        _lower_thread_priority(self._niceness)
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:
                    return
                args, self._pending = self._pending, None
            try:
                self._fn(*args)
            except Exception:
                logger.exception("coci: error in %s", self._name)

    def stop(self) -> None:
        """Finish the pending work, then end the thread."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join()
