"""Where checkpoints live: the Storage protocol, its backends, and the scheme registry that
opens them (see :func:`register_storage` for how to add one)."""

from __future__ import annotations

from coci_core.storage.base import STAGING_MARK, RecordStore, Storage, StorageWrapper, staging_name
from coci_core.storage.fsspec import FsspecStorage
from coci_core.storage.local import LocalStorage
from coci_core.storage.registry import (
    StorageFactory,
    check_storage_options,
    check_url,
    is_url,
    open_storage,
    open_storage_named,
    register_storage,
)

__all__ = [
    "STAGING_MARK",
    "FsspecStorage",
    "LocalStorage",
    "RecordStore",
    "Storage",
    "StorageFactory",
    "StorageWrapper",
    "check_storage_options",
    "check_url",
    "is_url",
    "open_storage",
    "open_storage_named",
    "register_storage",
    "staging_name",
]
