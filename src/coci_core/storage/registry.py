"""Which backend opens a checkpoint directory: a local path, or a URL by its scheme."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, TypeGuard

from coci_core.errors import ConfigError
from coci_core.storage.base import Storage
from coci_core.storage.fsspec import FsspecStorage
from coci_core.storage.local import LocalStorage

__all__ = ["StorageFactory", "is_url", "open_storage", "register_storage"]

#: Makes the storage of a URL: ``factory(url, **storage_options)``.
StorageFactory = Callable[..., Storage]

_FACTORIES: dict[str, StorageFactory] = {}
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def register_storage(scheme: str, factory: StorageFactory) -> None:
    """Open the URLs ``<scheme>://...`` with ``factory(url, **storage_options)``, instead of
    fsspec (which opens every scheme no backend registered: ``memory://``, ``file://``,
    ``s3://``, ``gs://``, ``az://`` ...). Registering a scheme again replaces its factory.

    To add a backend: 1) write a class in ``coci_core/storage/<name>.py`` (or your own package)
    that subclasses :class:`~coci_core.storage.Storage` and implements its required operations;
    2) override the optional capabilities it supports (``retire``, ``size``, ``free_bytes``,
    ``abort_uploads``, ``local_root``, ``record_store``, ``reads_in_chunks``); the defaults are
    what the engine does without them; 3) call ``register_storage("<scheme>", YourStorage)``
    when your module is imported. ``CheckpointManager("<scheme>://...")``, the adapters and
    the ``coci`` commands then open it; ``tests/storage/contract.py`` checks the required
    operations.

    Raises:
        ConfigError: ``scheme`` is not a URL scheme (letters, digits, ``+``, ``-``, ``.``;
            a letter first), or ``factory`` is not callable.
    """
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme.lower()):
        raise ConfigError(f"not a URL scheme: {scheme!r} (give it without '://')")
    if not callable(factory):
        raise ConfigError(f"the factory of {scheme!r} is not callable: {factory!r}")
    _FACTORIES[scheme.lower()] = factory


def is_url(target: object) -> TypeGuard[str]:
    """Whether ``target`` is a URL (``s3://...``), which coci keeps as a string."""
    return isinstance(target, str) and "://" in target


def open_storage(target: str | os.PathLike[str] | Storage, **storage_options: Any) -> Storage:
    """The storage for a local path, a URL (by its scheme: see :func:`register_storage`) or
    an existing :class:`Storage`.

    Raises:
        ConfigError: ``target`` is none of these.
    """
    if isinstance(target, os.PathLike):
        return LocalStorage(os.fspath(target))
    if isinstance(target, str):
        if not target:
            raise ConfigError("'directory' must be a non-empty path or URL: ''")
        if is_url(target):
            factory = _FACTORIES.get(target.split("://", 1)[0].lower(), FsspecStorage)
            return factory(target, **storage_options)
        return LocalStorage(target)
    if isinstance(target, Storage):
        return target
    raise ConfigError(
        f"'directory' must be a path, a URL or a Storage, got {type(target).__name__}"
    )
