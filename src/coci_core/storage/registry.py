"""Which backend opens a checkpoint directory: a local path, or a URL by its scheme."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeGuard

from coci_core.errors import ConfigError
from coci_core.storage.base import Storage
from coci_core.storage.fsspec import FsspecStorage
from coci_core.storage.local import LocalStorage

__all__ = [
    "ENTRY_POINTS",
    "StorageFactory",
    "check_storage_options",
    "check_url",
    "is_url",
    "open_storage",
    "open_storage_named",
    "register_storage",
]

#: The entry-point group of backends other packages install: ``<scheme> = "module:Factory"``.
ENTRY_POINTS = "coci.storage"

#: Makes the storage of a URL: ``factory(url, **storage_options)``.
StorageFactory = Callable[..., Storage]

_FACTORIES: dict[str, StorageFactory] = {}
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
# the installed backends' entry points by scheme, read once (at the first URL not registered)
_INSTALLED: dict[str, EntryPoint] | None = None
_LOCK = threading.Lock()


def register_storage(scheme: str, factory: StorageFactory) -> None:
    """Open the URLs ``<scheme>://...`` with ``factory(url, **storage_options)``, instead of
    fsspec (which opens every scheme no backend registered: ``memory://``, ``file://``,
    ``s3://``, ``gs://``, ``az://`` ...). Registering a scheme again replaces its factory.

    To add a backend: 1) write a class (in your own package, or ``coci_core/storage/<name>.py``)
    that subclasses :class:`~coci_core.storage.Storage`, sets ``url`` and ``renames`` and
    implements the required operations (``staging_dir`` is given: the engine owns the staging
    name); 2) override the optional capabilities it supports (``retire``, ``size``,
    ``free_bytes``, ``abort_uploads``, ``local_root``, ``record_store``, ``reads_in_chunks``);
    the defaults are what the engine does without them; 3) declare it in your package's
    metadata, ``[project.entry-points."coci.storage"] <scheme> = "module:YourStorage"``, which
    :func:`open_storage` loads the first time it meets ``<scheme>://`` (the ``coci`` command
    too), or call ``register_storage("<scheme>", YourStorage)`` (the way for a backend inside
    coci: at the end of its module, imported by ``coci_core/storage/__init__.py``).
    ``CheckpointManager("<scheme>://...")``, the adapters and the ``coci`` commands then open
    it; ``tests/storage/contract.py`` checks the required operations.

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


def check_storage_options(
    options: object, dirpath: object, *, names: tuple[str, str] = ("storage_options", "dirpath")
) -> dict[str, Any]:
    """``storage_options`` is None or a dict of fsspec options (str keys) for an fsspec URL
    ``dirpath`` (a string with ``://``); the dict to pass on, or a ConfigError naming it (which
    never shows the values: they hold credentials). ``names`` names the two arguments."""
    option_name, url_name = names
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(
            f"'{option_name}' must be a dict of fsspec options (str keys) or None, got "
            f"{type(options).__name__}"
        )
    if options and not is_url(dirpath):
        raise ConfigError(
            f"'{option_name}' apply to an fsspec URL '{url_name}' (e.g. 's3://bucket/run'), "
            f"not to {dirpath!r}"
        )
    return dict(options)


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
            check_url("directory", target)  # "://run" opened a local directory ":/run"
            factory = _factory(target.split("://", 1)[0].lower())
            return factory(target, **storage_options)
        return LocalStorage(target)
    if isinstance(target, Storage):
        return target
    raise ConfigError(
        f"'directory' must be a path, a URL or a Storage, got {type(target).__name__}"
    )


def _factory(scheme: str) -> StorageFactory:
    """The registered factory of ``scheme``, else an installed one (entry point ``coci.storage``
    named ``scheme``, loaded and registered now), else fsspec's."""
    factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory
    global _INSTALLED
    with _LOCK:
        if _INSTALLED is None:
            _INSTALLED = {e.name.lower(): e for e in entry_points(group=ENTRY_POINTS)}
        entry = _INSTALLED.get(scheme)
    if entry is None:
        return FsspecStorage
    try:
        loaded = entry.load()
    except Exception as e:  # an installed package's import error, whatever it is
        raise ConfigError(
            f"the storage backend of {scheme}:// ({entry.value}, entry point "
            f"{ENTRY_POINTS!r}) cannot be loaded: {type(e).__name__}: {e}"
        ) from e
    register_storage(scheme, loaded)
    return _FACTORIES[scheme]


# Schemes whose URL means nothing without a bucket (object stores) or a host (network
# protocols); others (``file``, ``memory``, ``hdfs``: its default name node) may leave it out.
_NEEDS_BUCKET_OR_HOST = frozenset(
    [
        "s3",
        "s3a",
        "gs",
        "gcs",
        "az",
        "abfs",
        "abfss",
        "adl",
        "oss",
        "r2",
        "b2",
        "http",
        "https",
        "ftp",
        "sftp",
        "ssh",
        "smb",
        "webhdfs",
    ]
)


def check_url(name: str, url: str) -> None:
    """Refuse, naming the argument ``name``, a URL whose scheme no backend opens: neither
    registered, nor installed (entry point), nor known to fsspec with its package installed
    (``gs://`` without ``gcsfs``, ``foo://``), or that is malformed: a scheme that is none
    (``://run``), no bucket or host where the scheme needs one (``s3://``, ``s3:///run``: the
    object stores and the network protocols; ``hdfs:///run`` names the default name node,
    ``file:///run`` the local disk). Nothing is connected to: a bucket that does not exist is
    found by the first save.

    Raises:
        ConfigError: naming ``name``, the URL and why.
    """
    target = url.rsplit("::", 1)[-1]  # fsspec's chained URLs: "simplecache::s3://bucket/run"
    scheme, _, rest = target.partition("://")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ConfigError(
            f"{name!r} is not a usable URL: {url!r}: its scheme {scheme!r} is not a scheme "
            "(a letter, then letters, digits, '+', '-' or '.': 's3://bucket/run')"
        )
    head = url.split("://", 1)[0].lower()
    if "::" not in head and _factory(head) is not FsspecStorage:
        return
    import fsspec

    for part in url.split("::"):  # fsspec's chained URLs: "simplecache::s3://bucket/run"
        protocol = part.split("://", 1)[0] if "://" in part else part
        try:
            fsspec.get_filesystem_class(protocol.lower())
        except (ValueError, ImportError) as e:
            raise ConfigError(f"{name!r} is not a usable fsspec URL: {url!r}: {e}") from e
    if scheme.lower() in _NEEDS_BUCKET_OR_HOST and not rest.split("/", 1)[0]:
        raise ConfigError(
            f"{name!r} is not a usable URL: {url!r}: it names no bucket or host after "
            f"'{scheme}://' (e.g. '{scheme}://bucket/run')"
        )


def open_storage_named(name: str, target: Any, storage_options: Mapping[str, Any]) -> Storage:
    """:func:`open_storage`, its errors naming the argument ``name`` (``'remote'``) where
    they would name ``'directory'``: a remote tier's URL that fsspec cannot open (no
    ``gcsfs`` for ``gs://``) said ``'directory' is not a usable fsspec URL``."""
    try:
        return open_storage(target, **dict(storage_options))
    except ConfigError as e:
        said = str(e)
        if not said.startswith("'directory'"):
            raise
        raise ConfigError(f"{name!r}{said[len(chr(39) + 'directory' + chr(39)) :]}") from e
