"""Where checkpoints live: the Storage protocol and its backends."""

from __future__ import annotations

import os
from typing import Any, TypeGuard

from coci_core.errors import ConfigError
from coci_core.storage.base import Storage
from coci_core.storage.fsspec import FsspecStorage
from coci_core.storage.local import LocalStorage

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "is_url", "open_storage"]


def is_url(target: object) -> TypeGuard[str]:
    """Whether ``target`` is an fsspec URL (``s3://...``), which coci keeps as a string."""
    return isinstance(target, str) and "://" in target


def open_storage(target: str | os.PathLike[str] | Storage, **storage_options: Any) -> Storage:
    """The storage for a local path, an fsspec URL (``memory://``, ``file://``, ``s3://`` ...)
    or an existing :class:`Storage`.

    Raises:
        ConfigError: ``target`` is none of these.
    """
    if isinstance(target, (LocalStorage, FsspecStorage)):
        return target
    if isinstance(target, os.PathLike):
        return LocalStorage(os.fspath(target))
    if isinstance(target, str):
        if not target:
            raise ConfigError("'directory' must be a non-empty path or URL: ''")
        if is_url(target):
            return FsspecStorage(target, **storage_options)
        return LocalStorage(target)
    if isinstance(target, Storage):
        return target
    raise ConfigError(
        f"'directory' must be a path, an fsspec URL or a Storage, got {type(target).__name__}"
    )
