"""Any fsspec file system (``memory://``, ``file://``, object stores); the manifest commits."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import coci_core.storage.s3_parallel as s3_parallel
from coci_core.errors import ConfigError, StorageError
from coci_core.knobs import S3_PART_BYTES
from coci_core.storage.base import RecordStore, Storage, staging_name

__all__ = ["FsspecStorage"]

_MANIFEST = "manifest.json"


class FsspecStorage(Storage):
    """A directory under an fsspec URL.

    Object stores have no atomic rename, so a checkpoint is written in place and the manifest,
    written last as a single object, is the commit marker: a step without it does not exist.
    Each save names its data files after itself, so re-saving a committed step never touches
    the files of the old one: the new manifest replaces the old in one put (written aside, then
    moved), and only then are the old files deleted.

    A store that cannot be read or written (refused credentials or permission, a missing
    bucket, a server that cannot be reached) raises a :class:`StorageError` naming the URL and
    the cause; only a missing *prefix* in an existing bucket lists as an empty directory.

    Declares ``retire``, ``abort_uploads`` (S3), ``local_root`` (``file://``) and
    ``record_store`` (a store other machines share).
    """

    renames = False  # object stores have no atomic rename: the manifest is the commit

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a dependency
            raise ConfigError("fsspec URLs need the 'fsspec' package: pip install fsspec") from e
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"'directory' is not a usable fsspec URL: {url!r}: {e}") from e
        self.root = root.rstrip("/")
        self.url = url

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _failures(self, action: str, path: str) -> _Failures:
        """A context that raises what the store's client raises as a StorageError naming the
        URL and the cause (see :meth:`_failure`)."""
        return _Failures(self, action, path)

    def _failure(self, action: str, path: str, error: BaseException) -> StorageError:
        """The StorageError for ``error``, a failure to ``action`` ``path``."""
        where = f"{self.url}/{path}" if path else self.url
        wrapped = StorageError.wrap(f"cannot {action} {where}: {self._why(error)}", error)
        if _told_in_full(error):
            # refused or missing credentials, a missing bucket: the message says it all, and
            # botocore's and s3fs's errors chained before it would bury it (raise it bare)
            wrapped.__cause__ = None
            wrapped.__suppress_context__ = True
        else:
            wrapped.__cause__ = error
        return wrapped

    def _why(self, error: BaseException) -> str:
        """The cause of a store's error, in words (credentials never appear in them)."""
        text = str(error) or type(error).__name__
        if _names_missing_bucket(error):
            return f"the bucket {self.root.split('/', 1)[0]!r} does not exist ({text})"
        if isinstance(error, PermissionError):
            return (
                f"access denied ({text}): check the credentials (storage_options or the "
                "environment) and their permissions"
            )
        botocore = sys.modules.get("botocore.exceptions")
        if botocore is not None and isinstance(error, botocore.NoCredentialsError):
            return f"no credentials ({text}): pass them in storage_options or the environment"
        if botocore is not None and isinstance(error, botocore.ConnectionError):
            return f"the store cannot be reached ({text})"
        return text

    def list_dir(self, path: str = "") -> list[str]:
        full = self._path(path)
        # Other processes (the other ranks, another writer) change the store: never answer
        # from this process's cached listings.
        self.fs.invalidate_cache(full)
        with self._failures("list", path):
            try:
                names = self.fs.ls(full, detail=False)
            except FileNotFoundError as e:
                if _names_missing_bucket(e):
                    raise  # an error; a missing prefix is an empty directory
                return []
        return sorted({str(n).rstrip("/").rsplit("/", 1)[-1] for n in names})

    def exists(self, path: str) -> bool:
        full = self._path(path)
        self.fs.invalidate_cache(full)  # see list_dir
        with self._failures("read", path):
            try:
                # info, not fs.exists: that one answers False for a bucket that is missing
                self.fs.info(full)
            except FileNotFoundError as e:
                if _names_missing_bucket(e):
                    raise
                return False
        return True

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        full = self._path(path)
        with self._failures("write", path):
            parent = full.rsplit("/", 1)[0]
            with contextlib.suppress(FileExistsError):
                self.fs.makedirs(parent, exist_ok=True)
            written = 0
            # A manifest replaces an older one in one step: written aside, then moved.
            atomic = full.rsplit("/", 1)[-1] == _MANIFEST
            if not atomic and s3_parallel.is_s3(self.fs):
                written = s3_parallel.upload(self.fs, full, chunks)
                self.fs.invalidate_cache(parent)
                return written
            target = staging_name(full, uuid.uuid4().hex[:12]) if atomic else full
            with self.fs.open(target, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    written += chunk.nbytes
                _fsync_if_local(f)
            if atomic:
                self.fs.mv(target, full)
        return written

    def _local(self, path: str) -> str | None:
        """The OS path of ``path`` when this file system is the local one."""
        return self._path(path) if getattr(self.fs, "local_file", False) else None

    def size(self, path: str) -> int:
        """The size of the file at ``path`` (on a local file system: a regular file only; a
        FIFO or a device could block or never end)."""
        local = self._local(path)
        with self._failures("read", path):
            if local is not None:
                st = os.stat(local)
                if not stat.S_ISREG(st.st_mode):
                    raise StorageError(f"cannot read {self.url}/{path}: not a regular file")
                return st.st_size
            info = self.fs.info(self._path(path))
        size = info.get("size")
        if info.get("type") != "file" or type(size) is not int or size < 0:
            raise StorageError(f"cannot read {self.url}/{path}: not a file of known size")
        return size

    def read_bytes(self, path: str) -> bytes:
        with self._failures("read", path):
            if self._local(path) is not None:
                self.size(path)  # a regular file, not a FIFO or a device
            return bytes(self.fs.cat_file(self._path(path)))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        with self._failures("read", path):
            if self._local(path) is not None:
                size = self.size(path)  # a regular file, not a FIFO or a device
                if offset + len(view) > size:
                    raise StorageError(
                        f"{self.url}/{path} is shorter than expected: needed {len(view)} bytes "
                        f"at offset {offset}, it has {size}"
                    )
            if len(view) > S3_PART_BYTES and s3_parallel.is_s3(self.fs):
                got = s3_parallel.read_ranges(self.fs, self._path(path), offset, view)
                if got != len(view):
                    raise StorageError(
                        f"{self.url}/{path} is shorter than expected: needed {len(view)} "
                        f"bytes at offset {offset}, got {got}"
                    )
                return
            data = self.fs.cat_file(self._path(path), start=offset, end=offset + len(view))
        if len(data) != len(view):
            raise StorageError(
                f"{self.url}/{path} is shorter than expected: needed {len(view)} bytes at "
                f"offset {offset}, got {len(data)}"
            )
        view[:] = data

    def remove_dir(self, path: str) -> None:
        full = self._path(path)
        with contextlib.suppress(StorageError), self._failures("remove", path):
            self.fs.rm(full, recursive=True)
        if {"s3", "s3a"} & self._protocols():
            # S3 servers with real folders (SeaweedFS's filer, for one) keep an empty folder
            # after its objects are deleted, listed as a directory: delete its "dir/" key too.
            with contextlib.suppress(StorageError), self._failures("remove", path):
                bucket, key, _ = self.fs.split_path(full)
                if key:
                    self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
            self.fs.invalidate_cache(full)

    def abort_uploads(self) -> int:
        """Abort the multipart uploads a killed writer left open under this directory (S3
        only; call only while holding the directory's owner record); the number aborted."""
        if not s3_parallel.is_s3(self.fs):
            return 0
        with self._failures("list the uploads of", ""):
            return s3_parallel.abort_uploads(self.fs, self.root)

    def publish(self, staging: str, final: str) -> None:
        """The manifest is already in place; delete what an older save of the step left."""
        if staging != final:
            raise StorageError(f"cannot publish {staging!r} as {final!r}: no rename here")
        try:
            doc = json.loads(self.read_bytes(f"{final}/{_MANIFEST}"))
            kept = {str(f["name"]) for f in doc["files"]} | {_MANIFEST}
            names = self.list_dir(final)
        except (StorageError, ValueError, KeyError, TypeError):
            return  # nothing is deleted unless the new manifest says what it needs
        for name in names:
            if name not in kept and name.startswith(("data-", f"{_MANIFEST}.coci-tmp-")):
                # the step is committed: what is left of an older save is only clutter
                with contextlib.suppress(StorageError), self._failures("remove", final):
                    self.fs.rm(self._path(f"{final}/{name}"))

    def retire(self, final: str) -> None:
        """Un-publish a committed step (delete its manifest first), then delete its files."""
        with self._failures("remove", final), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(f"{final}/{_MANIFEST}"))
        self.remove_dir(final)

    # -- the owner record of an object store (see coci_core.engine.directory.lease) ----------

    def _protocols(self) -> set[str]:
        p = self.fs.protocol
        return set(p) if isinstance(p, (tuple, list)) else {str(p)}

    def record_store(self) -> RecordStore | None:
        """This storage, when other processes (other machines) can write to it too: not the
        local file system (its lease is a ``flock`` in :meth:`local_root`) and not
        ``memory://`` (private to this process)."""
        if self.local_root() is None and "memory" not in self._protocols():
            return self
        return None

    def read_record(self, path: str) -> tuple[bytes, str | None] | None:
        """A small object and its ETag (None where the store has none); None when absent."""
        full = self._path(path)
        with self._failures("read", path):
            try:
                self.fs.invalidate_cache(full)
                info = self.fs.info(full)
                data = bytes(self.fs.cat_file(full))
            except FileNotFoundError as e:
                if _names_missing_bucket(e):
                    raise
                return None
        etag = info.get("ETag") or info.get("etag")
        return data, (str(etag) if etag else None)

    def put_record(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write a small object in one put, conditionally where the store can.

        ``if_absent``: only if nothing is there (S3 ``If-None-Match: *``, fsspec's
        ``mode="create"``). ``if_match``: only if the object still has this ETag (S3
        ``If-Match``; elsewhere a read-and-compare before the put, not atomic). Returns the new
        ETag when the store reports one.

        Raises:
            FileExistsError: the condition does not hold (someone else wrote or holds it).
            StorageError: the store cannot be written.
        """
        full = self._path(path)
        s3 = bool({"s3", "s3a"} & self._protocols())
        kwargs: dict[str, Any] = {}
        if if_absent:
            kwargs["mode"] = "create"
        elif if_match is not None:
            if s3:
                kwargs["IfMatch"] = if_match
            else:
                current = self.read_record(path)
                if current is None or current[1] != if_match:
                    raise FileExistsError(f"{self.url}/{path} changed")
        try:
            try:
                out = self.fs.pipe_file(full, data, **kwargs)
            except (TypeError, NotImplementedError):
                if not if_absent:
                    raise
                # A file system whose pipe_file has no mode="create": check, then put (not
                # atomic; the owner's heartbeat finds a lost race at its next renewal).
                if self.fs.exists(full):
                    raise FileExistsError(f"{self.url}/{path} exists") from None
                out = self.fs.pipe_file(full, data)
        except FileExistsError:
            raise
        except OSError as e:
            # s3fs raises PreconditionFailed (HTTP 412) as OSError(EINVAL)
            if (if_absent or if_match is not None) and (
                e.errno == errno.EINVAL or "precondition" in str(e).lower()
            ):
                raise FileExistsError(f"{self.url}/{path}: {e}") from e
            if if_match is not None and _gone(e):  # If-Match on an object deleted meanwhile
                raise FileExistsError(f"{self.url}/{path} is gone: {e}") from e
            raise self._failure("write", path, e)  # noqa: B904 (its cause: see _failure)
        except (TypeError, NotImplementedError, ValueError) as e:
            raise StorageError(f"{self.url} cannot write {path} conditionally: {e}") from e
        except Exception as e:
            if not _is_store_error(e):
                raise
            raise self._failure("write", path, e)  # noqa: B904 (its cause: see _failure)
        etag = out.get("ETag") if isinstance(out, dict) else None
        if etag is None:
            with contextlib.suppress(StorageError), self._failures("read", path):
                etag = self.fs.info(full).get("ETag")
        return str(etag) if etag else None

    def remove_record(self, path: str) -> None:
        with self._failures("remove", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(path))

    def local_root(self) -> str | None:
        """The local path of this storage when fsspec's file system is the local one."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return self.root if {"file", "local"} & set(protocols) else None


class _Failures:
    """See :meth:`FsspecStorage._failures`."""

    def __init__(self, storage: FsspecStorage, action: str, path: str) -> None:
        self.storage = storage
        self.action = action
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: Any
    ) -> None:
        if error is None or isinstance(error, StorageError) or not _is_store_error(error):
            return
        raise self.storage._failure(self.action, self.path, error)  # its cause: see _failure


def _is_store_error(error: BaseException) -> bool:
    """Whether ``error`` is a failure of the store or of reaching it (fsspec raises OSError
    and ValueError; s3fs lets botocore's connection and credential errors through)."""
    if isinstance(error, (OSError, ValueError)):
        return True
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(error, botocore.BotoCoreError)


def _told_in_full(error: BaseException) -> bool:
    """Whether :meth:`FsspecStorage._why` words all there is to know of ``error``."""
    botocore = sys.modules.get("botocore.exceptions")
    no_credentials = botocore is not None and isinstance(error, botocore.NoCredentialsError)
    return isinstance(error, PermissionError) or no_credentials or _names_missing_bucket(error)


def _error_codes(error: BaseException) -> Iterator[str]:
    """The S3 error codes (``NoSuchBucket`` ...) of ``error`` and the errors it came from
    (s3fs keeps botocore's error as the cause or the context of its own)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                yield str(code)
        seen = seen.__cause__ or seen.__context__


def _names_missing_bucket(error: BaseException) -> bool:
    return "NoSuchBucket" in set(_error_codes(error))


def _gone(error: OSError) -> bool:
    """A missing object (not a missing bucket)."""
    return isinstance(error, FileNotFoundError) and not _names_missing_bucket(error)


def _fsync_if_local(f: Any) -> None:
    # fsspec's local files wrap a real file object: make them durable like LocalStorage does.
    with contextlib.suppress(AttributeError, OSError, ValueError):
        f.flush()
        os.fsync(f.fileno())
