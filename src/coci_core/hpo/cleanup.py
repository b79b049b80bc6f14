"""Deleting a stopped run's checkpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coci_core.engine.directory.lease import DELETED_MARK, LEASE_NAME, acquire_lease
from coci_core.errors import DirectoryInUseError
from coci_core.storage import Storage, is_url, open_storage

__all__ = ["delete_checkpoints", "delete_checkpoints_unwritten"]

logger = logging.getLogger(__name__)


def delete_checkpoints(directory: str | os.PathLike[str] | Storage, **storage_options: Any) -> int:
    """Delete everything under a run's checkpoint directory (call it once the run's adapter
    is closed); returns the number of entries deleted (0 when it does not exist)."""
    if not isinstance(directory, Storage) and not is_url(directory):
        path = Path(directory)
        count = len(list(path.iterdir())) if path.is_dir() else 0
        shutil.rmtree(path, ignore_errors=True)
        return count
    storage = open_storage(directory, **storage_options)
    names = storage.list_dir("")
    for name in names:
        storage.remove_dir(name)
    return len(names)


def delete_checkpoints_unwritten(
    directory: str | os.PathLike[str] | Storage,
    *,
    deadline: float,
    waiting: Callable[[], None] | None = None,
    **storage_options: Any,
) -> int | None:
    """:func:`delete_checkpoints`, once no writer holds the directory's lease, and holding it
    meanwhile: a stopped run whose process still lives (a Ray trial's actor, still shutting
    down, whose writer thread makes a pending save durable) writes nothing into the directory
    after it is cleaned (its writer holds the lease until its last save is durable; a writer
    that takes it later finds it taken). Waits until ``deadline`` (``time.monotonic()``),
    calling ``waiting`` once when it begins to; None when a writer still held it then
    (nothing deleted).

    Before it deletes, it leaves a file ``coci-deleted-<token>`` there (the directory is made
    for it when there is none), which stays: a manager made before it (the stopped run's,
    which holds no lease before its first save) refuses to take the lease then, so that its
    first save, late, does not write into the directory again (a manager made after it, a new
    run in the directory, writes there as usual)."""
    local = not isinstance(directory, Storage) and not is_url(directory)
    storage = open_storage(directory, **({} if local else storage_options))
    told = False
    while True:
        try:
            lease = acquire_lease(storage, "coci-cleanup")
            break
        except DirectoryInUseError:
            if time.monotonic() >= deadline:
                return None
            if not told and waiting is not None:
                waiting()
            told = True
            time.sleep(0.05)  # the writer's process ends, or closes its manager
    try:
        mark = f"{DELETED_MARK}{uuid.uuid4().hex}"
        storage.write_file(mark, [memoryview(b"deleted by a clean-up of a stopped run\n")])
        count = 0
        root = storage.local_root()
        if root is not None:  # a local directory: its files too (not only directories)
            for entry in Path(root).iterdir():
                if entry.name in (mark, LEASE_NAME):
                    continue
                count += 1
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            return count
        for name in storage.list_dir(""):
            if name not in (mark, LEASE_NAME):
                storage.remove_dir(name)
                count += 1
        return count
    finally:
        with contextlib.suppress(Exception):
            lease.release()
