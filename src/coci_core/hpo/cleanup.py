"""Deleting a stopped run's checkpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coci_core.engine.directory.lease import acquire_lease
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
    (nothing deleted)."""
    if not isinstance(directory, Storage) and not is_url(directory):
        if not Path(directory).is_dir():
            return 0  # no lease to take: taking it would make the directory
        storage: Storage = open_storage(directory)
    else:
        storage = open_storage(directory, **storage_options)
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
    try:  # a local directory is removed whole; a store's, through the storage opened above
        local = not isinstance(directory, Storage) and not is_url(directory)
        return delete_checkpoints(directory if local else storage)
    finally:
        with contextlib.suppress(Exception):  # its record went with the directory
            lease.release()
