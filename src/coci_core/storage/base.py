"""The Storage protocol: every operation coci needs from a place that holds checkpoints.

A backend implements the required operations and inherits the optional capabilities' defaults
by subclassing :class:`Storage` (or :class:`StorageWrapper`, to wrap another storage); it
overrides a capability to declare it. The engine calls each capability and reads its answer
(``None``, ``0``, ``False``: not supported); it never checks a backend's type or probes for
methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

__all__ = ["STAGING_MARK", "RecordStore", "Storage", "StorageWrapper", "staging_name"]

#: What a staging directory's name holds between the step's name and the save's token: the
#: cleanup of a crash's partial writes (engine/directory/retention.py) finds them by it.
STAGING_MARK = ".coci-tmp-"


def staging_name(final: str, token: str) -> str:
    """The directory a save writes into before it is published as ``final``:
    ``{final}.coci-tmp-{token}``. The engine owns this name (backends never make it up)."""
    return f"{final}{STAGING_MARK}{token}"


@runtime_checkable
class RecordStore(Protocol):
    """Small objects written conditionally, shared with other machines: where an object store
    keeps the writer's owner record (see :mod:`coci_core.engine.directory.lease`)."""

    url: str

    def read_record(self, path: str) -> tuple[bytes, str | None] | None:
        """A small object and its ETag (None where the store has none); None when absent."""
        ...

    def put_record(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write a small object in one put, only if absent (``if_absent``) or only if it still
        has the ETag ``if_match``; the new ETag, when the store reports one.

        Raises:
            FileExistsError: the condition does not hold.
        """
        ...

    def remove_record(self, path: str) -> None:
        """Delete a small object (no error if absent)."""
        ...


@runtime_checkable
class Storage(Protocol):
    """A tree of files addressed by '/'-separated paths relative to the storage's root.

    Called as: (writer) 1) ``staging_dir(final, token)`` (given here: a backend does not
    override it); 2) ``write_file`` for each data file, then for the manifest, each durable
    when it returns; 3) ``publish(staging, final)``, after which the checkpoint is visible
    under ``final``. (reader) ``list_dir``, ``exists``, ``read_bytes``, ``read_into``.
    (coordinator) ``retire`` and ``remove_dir`` for retention and cleanup.

    A backend implements ``list_dir`` to ``remove_dir`` and ``publish``, and sets ``url`` and
    ``renames``. The methods below ``publish`` are optional capabilities: their defaults here
    are what the engine does without them, and a subclass overrides those its storage supports.
    """

    url: str
    #: True: ``staging_dir`` is a directory of its own that ``publish`` renames into place
    #: (several ranks may write one checkpoint). False: the data goes straight into the final
    #: directory and the manifest, written last, commits it (object stores).
    renames: bool

    def list_dir(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (empty when it does not exist)."""
        ...

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""
        ...

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        """Write ``chunks`` as the whole file at ``path``, durably; return the bytes written.

        ``aligned`` promises page-aligned buffers and lengths (direct I/O may be used).
        """
        ...

    def read_bytes(self, path: str) -> bytes:
        """The whole file at ``path``."""
        ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset``; raise if the file is short."""
        ...

    def remove_dir(self, path: str) -> None:
        """Delete the directory ``path`` and everything under it (no error if absent)."""
        ...

    def staging_dir(self, final: str, token: str) -> str:
        """The directory a save writes into before it is published as ``final``: with
        ``renames``, :func:`staging_name` (``{final}.coci-tmp-{token}``, the name by which the
        next manager finds and deletes what a crash left); without, ``final`` itself. Not
        overridden by backends."""
        return staging_name(final, token) if self.renames else final

    def publish(self, staging: str, final: str) -> None:
        """Make the staged checkpoint visible as ``final``.

        With ``renames``: move the directory ``staging`` to ``final`` atomically (a crash
        leaves one or the other, whole). When ``final`` exists (a step saved again), replace
        it so that a crash leaves the old step or the new one, never neither for good.

        Without ``renames``: ``staging == final`` and the manifest, written last, has already
        committed the step. Then delete, after reading the new manifest, the files under
        ``final`` that an older save of the same step left and the new manifest does not list
        (its data files, ``data-*``, and manifests written aside, ``manifest.json.coci-tmp-*``);
        never a file the new manifest lists, and nothing at all if the new manifest cannot be
        read. A failed deletion is not an error (the step is committed; it is only clutter).
        """
        ...

    # -- optional capabilities -------------------------------------------------------------

    def retire(self, final: str) -> None:
        """Delete the committed step ``final`` so that no crash leaves its manifest without
        its data (un-publish it first). Default: ``remove_dir``."""
        self.remove_dir(final)

    def size(self, path: str) -> int | None:
        """The size of the file at ``path`` without reading it; None: unknown (the default).
        Restore checks what a manifest claims against it before it allocates anything."""
        return None

    def free_bytes(self) -> int | None:
        """Free bytes where checkpoints go; None: unknown (the default: no early retention
        before a save that would not fit)."""
        return None

    def abort_uploads(self) -> int:
        """Abort the uploads a killed writer left open here; the number aborted (called at
        startup under the directory's lease). Default: none to abort (0)."""
        return 0

    def local_root(self) -> str | None:
        """The local directory that holds the files, where the writer's lease is an
        ``flock``; None (the default): not on the local file system."""
        return None

    def record_store(self) -> RecordStore | None:
        """Where the writer's owner record goes when other machines can write here too (an
        object store); None (the default): the lease stays within this process (or is the
        ``flock`` of :meth:`local_root`)."""
        return None

    def read_session(self) -> contextlib.AbstractContextManager[None]:
        """A scope for many reads of the same files (a restore): a storage may keep what it
        opened for them until the scope ends. Default: nothing kept."""
        return contextlib.nullcontext()

    @property
    def reads_in_chunks(self) -> bool:
        """Whether restore should read large pieces with :meth:`read_chunks` (checksumming
        each chunk while the next is read) rather than one ``read_into``, and read several
        arrays at once: :meth:`read_chunks` and :meth:`read_into` are then called from several
        threads together. Default: False."""
        return False

    def read_chunks(
        self, path: str, offset: int, out: memoryview, chunk_bytes: int
    ) -> Iterator[memoryview]:
        """Fill ``out`` from the file's byte ``offset`` in reads of ``chunk_bytes``, yielding
        each part of ``out`` once it is filled. Default: a ``read_into`` per part."""
        view = out.cast("B")
        for start in range(0, len(view), chunk_bytes):
            part = view[start : start + chunk_bytes]
            self.read_into(path, offset + start, part)
            yield part


class StorageWrapper(Storage):
    """A storage that passes every required operation to ``inner``: subclass it and override
    the operations to intercept (tests inject faults this way).

    The lease follows ``inner`` (the wrapper writes the same directory). The other optional
    capabilities keep the defaults, built on the wrapper's own operations, so that every read
    and deletion goes through the wrapper; override one to delegate it too.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.renames = inner.renames

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        return self.inner.write_file(path, chunks, aligned=aligned)

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)

    def remove_dir(self, path: str) -> None:
        self.inner.remove_dir(path)

    def publish(self, staging: str, final: str) -> None:
        self.inner.publish(staging, final)

    def local_root(self) -> str | None:
        return self.inner.local_root()

    def record_store(self) -> RecordStore | None:
        return self.inner.record_store()
