"""One writer per checkpoint directory: an owner lease that a second writer detects.

A manager that writes takes the lease of its directory before it touches anything in it
(cleanup of leftovers included). Within one process the lease is a registry entry per
storage URL; on a local file system (a path or ``file://``) it is also an exclusive
``flock`` on ``<dir>/.coci-owner``, which the kernel releases when the owning process dies
(``kill -9`` included), so a lease is never left behind by a crash. Object stores get the
in-process check only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any

from coci_core.errors import DirectoryInUseError, StorageError

__all__ = ["LEASE_NAME", "Lease", "acquire_lease"]

LEASE_NAME = ".coci-owner"

_HELD: dict[str, str] = {}
# Re-entrant: a manager freed by the garbage collector inside acquire_lease releases its own.
_HELD_LOCK = threading.RLock()


class Lease:
    """A held lease; :meth:`release` (idempotent) gives it up."""

    def __init__(self, key: str, fd: int | None) -> None:
        self.key = key
        self._fd = fd
        self._released = False

    def release(self) -> None:
        with _HELD_LOCK:
            if self._released:
                return
            self._released = True
            _HELD.pop(self.key, None)
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)  # closing the descriptor drops the flock
                self._fd = None


def _local_root(storage: Any) -> str | None:
    seen = 0
    while storage is not None and seen < 8:  # wrappers (tests, tools) keep theirs in .inner
        from coci_core.storage import FsspecStorage, LocalStorage

        if isinstance(storage, LocalStorage):
            return str(storage.root)
        if isinstance(storage, FsspecStorage):
            return storage.local_root()
        storage = getattr(storage, "inner", None)
        seen += 1
    return None


def _holder_text(info: str) -> str:
    try:
        doc = json.loads(info)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return f"process {int(doc['pid'])} on {str(doc['host'])[:64]} since {since}"
    except (ValueError, KeyError, TypeError, OverflowError):
        return "another process"


def acquire_lease(storage: Any, session: str) -> Lease:
    """Take the writer's lease of ``storage``'s directory.

    Raises:
        DirectoryInUseError: another manager (of this process or a live other one) holds it.
        StorageError: the lease file cannot be created.
    """
    key = str(storage.url)
    info = json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "session": session, "since": time.time()}
    )
    with _HELD_LOCK:
        if key in _HELD:
            raise DirectoryInUseError(
                f"another CheckpointManager of this process ({_holder_text(_HELD[key])}) is "
                f"writing to {key}: close() it first, or give each run its own directory"
            )
        root = _local_root(storage)
        fd = None
        if root is not None:
            path = os.path.join(root, LEASE_NAME)
            try:
                os.makedirs(root, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise StorageError.wrap(f"cannot create the lease file {path}: {e}", e) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = b""
                with contextlib.suppress(OSError):
                    holder = os.pread(fd, 4096, 0)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise StorageError.wrap(f"cannot lock {path}: {e}", e) from e
                raise DirectoryInUseError(
                    f"another coci writer ({_holder_text(holder.decode('utf-8', 'replace'))}) "
                    f"is writing to {key}: wait for it to finish, or give each run its own "
                    "directory"
                ) from None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
        _HELD[key] = info
    return Lease(key, fd)
