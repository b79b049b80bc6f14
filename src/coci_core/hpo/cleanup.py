"""Deleting a stopped run's checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from coci_core.storage import Storage, is_url, open_storage

__all__ = ["delete_checkpoints"]


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
