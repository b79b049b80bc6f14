"""The Storage protocol: the few operations coci needs from a place that holds checkpoints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = ["Storage"]


@runtime_checkable
class Storage(Protocol):
    """A tree of files addressed by '/'-separated paths relative to the storage's root.

    Called as: (writer) 1) ``staging_dir(final, token)``; 2) ``write_file`` for each data file,
    then for the manifest, each durable when it returns; 3) ``publish(staging, final)``, after
    which the checkpoint is visible under ``final``. (reader) ``list_dir``, ``exists``,
    ``read_bytes``, ``read_into``. (coordinator) ``remove_dir`` for retention and cleanup.
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
        """The directory to write a checkpoint into before it is published as ``final``."""
        ...

    def publish(self, staging: str, final: str) -> None:
        """Make the staged checkpoint visible as ``final`` atomically."""
        ...
