"""One writer per checkpoint directory: an owner lease that a second writer detects.

A manager that writes takes the lease of its directory before it touches anything in it
(cleanup of leftovers included). Within one process the lease is a registry entry per
storage URL; on a local file system (a path or ``file://``) it is also an exclusive
``flock`` on ``<dir>/.coci-owner``, which the kernel releases when the owning process dies
(``kill -9`` included), so a lease is never left behind by a crash. ``memory://`` gets the
in-process check only (no other process can see it).

On an object store (S3, GCS, Azure ... through fsspec) nothing dies with the owner, so the lease
is an owner record ``<dir>/.coci-owner`` created with a conditional put (S3 ``If-None-Match: *``:
of two writers racing, exactly one creates it) and renewed by a heartbeat thread every
``LEASE_TTL_S / 3`` seconds (S3 ``If-Match``: a renewal never overwrites another owner's
record). A record not renewed for ``LEASE_TTL_S`` seconds is stale (its writer died), and so
at once is the record of a process of this machine that is gone (a crash restarted on the same
node): the next writer takes it over, with a conditional put again.

A writer that could not renew its record for ``LEASE_TTL_S`` (the store was down) writes
nothing there until it has renewed it again, which it does (heartbeat, next save, next upload)
once the store answers, if the record is still its own or free; a writer whose record another
one took over loses its lease for good, and its next ``save`` raises
:class:`DirectoryInUseError`. Staleness compares the record's wall-clock time with the
reader's: clocks must agree to well within ``LEASE_TTL_S``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import weakref
from typing import Any

from coci_core.errors import DirectoryInUseError, StorageError
from coci_core.knobs import LEASE_TTL_S
from coci_core.storage import RecordStore, Storage
from coci_core.storage.local import open_own_file

__all__ = ["DELETED_MARK", "LEASE_NAME", "LEASE_TTL_S", "Lease", "acquire_lease", "deletion_marks"]

#: the longest time to live a lease record may give itself (writers give ``LEASE_TTL_S``): a
#: record that claims longer is not a writer's, so it cannot lock a directory for days
MAX_LEASE_TTL_S = 24 * 3600.0

logger = logging.getLogger(__name__)

LEASE_NAME = ".coci-owner"

#: the name's start of the file a clean-up (``delete_checkpoints_unwritten``) leaves in the
#: directory whose checkpoints it deleted, under its lease, before it deletes them: a manager
#: made before it (a stopped run's, whose first save comes late) refuses to take the lease
#: then, so that nothing of the stopped run is written there again. Not a ``.coci-`` name: a
#: writer's clean-up of leftovers (``remove_uncommitted``) leaves it alone.
DELETED_MARK = "coci-deleted-"


def deletion_marks(names: list[str]) -> frozenset[str]:
    """The clean-ups' marks among a directory's ``names``."""
    return frozenset(n for n in names if n.startswith(DELETED_MARK))


_HELD: dict[str, str] = {}
# Re-entrant: a manager freed by the garbage collector inside acquire_lease releases its own.
_HELD_LOCK = threading.RLock()
_LEASES: weakref.WeakSet[Lease] = weakref.WeakSet()  # this process's, for _forget_in_child


class Lease:
    """A held lease; :meth:`release` (idempotent) gives it up."""

    def __init__(self, key: str, fd: int | None, remote: _OwnerRecord | None = None) -> None:
        self.key = key
        self._fd = fd
        self._remote = remote
        self._released = False
        _LEASES.add(self)

    @property
    def lost(self) -> str | None:
        """Why this lease is no longer held for good (another writer took an object store's
        record over), or None."""
        return None if self._remote is None else self._remote.lost

    @property
    def generation(self) -> int:
        """How many times an object store's record was taken again after the lease lapsed
        (0 for a local lease): another writer may have written meanwhile, so what this writer
        read of the directory under the lease (its highest commit sequence) is read again."""
        return 0 if self._remote is None else self._remote.generation

    @property
    def lapsed(self) -> str | None:
        """Why this writer may not write now: the lease is lost, or an object store's record
        was not renewed within the lease time (the store could not be reached); None while it
        is held. A lapsed lease is taken again by :meth:`ensure_held` or the heartbeat."""
        return None if self._remote is None else self._remote.lapsed

    def ensure_held(self) -> None:
        """Return once this writer holds the lease: a lease that lapsed while the store could
        not be reached is taken again first, if its record is still this writer's or free
        (a conditional write, so no other writer's record is overwritten).

        Raises:
            DirectoryInUseError: another writer took the record over.
            StorageError: the lease lapsed and the store still cannot be written.
        """
        if self._remote is not None:
            self._remote.ensure_held()

    def release(self) -> None:
        with _HELD_LOCK:
            if self._released:
                return
            self._released = True
            _HELD.pop(self.key, None)
            if self._remote is not None:
                self._remote.release()
            fd, self._fd = self._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the descriptor drops the flock


class _OwnerRecord:
    """The owner record of an object store, renewed by a heartbeat thread while held.

    A renewal that fails because the store cannot be reached is retried at every beat; once
    none succeeded for the lease time the lease has lapsed (another writer may take the record
    over as stale, so nothing is written meanwhile) until a renewal succeeds again: the record
    is still this writer's (If-Match on its ETag) or free (If-None-Match). Only a record that
    another writer holds loses the lease for good.
    """

    def __init__(
        self, storage: RecordStore, doc: dict[str, Any], etag: str | None, ttl: float
    ) -> None:
        self.storage = storage
        self.doc = doc
        self.etag = etag
        self.ttl = ttl
        #: when the last successful renewal started (the record's time is no earlier)
        self.renewed = time.monotonic()
        self.lost: str | None = None
        self.last_error: str | None = None
        self.generation = 0  # see Lease.generation
        self._renewing = threading.Lock()  # the heartbeat, the writer and the uploader
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="coci-lease", daemon=True)
        self._thread.start()

    @property
    def lapsed(self) -> str | None:
        """See :attr:`Lease.lapsed`."""
        if self.lost is not None:
            return self.lost
        age = time.monotonic() - self.renewed
        if age <= self.ttl:
            return None
        return (
            f"the lease of {self.storage.url} was not renewed for {age:.0f} s (its lease time "
            f"is {self.ttl:g} s): {self.last_error or 'the store did not answer'}"
        )

    def _beat(self) -> None:
        told = ""  # what was logged of the current failure: "", "failing", "lapsed"
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except FileExistsError:
                pass  # renew() recorded why in self.lost
            except Exception as e:  # a store that is down (any client error): retried
                lapsed = self.lapsed
                if lapsed is not None and told != "lapsed":
                    logger.error("coci: %s; nothing is written there until it is renewed", lapsed)
                    told = "lapsed"
                elif not told:
                    logger.warning("coci: cannot renew the lease of %s: %s", self.storage.url, e)
                    told = "failing"
                else:
                    logger.debug("coci: cannot renew the lease of %s: %s", self.storage.url, e)
            else:
                told = ""
            if self.lost is not None:
                logger.error("coci: %s; saves to it are refused from now on", self.lost)
                return

    def ensure_held(self) -> None:
        """See :meth:`Lease.ensure_held`."""
        if self.lapsed is None:
            return
        try:
            self.renew()
        except FileExistsError:
            pass
        except Exception as e:
            lapsed = self.lapsed
            if lapsed is None:  # renewed meanwhile (by the heartbeat)
                return
            raise StorageError(f"{lapsed}; nothing is written there until it is renewed") from e
        if self.lost is not None:
            raise DirectoryInUseError(
                f"{self.lost}: this writer no longer owns {self.storage.url}"
            ) from None
        lapsed = self.lapsed
        if lapsed is not None:  # released meanwhile: nothing renews it any more
            raise StorageError(f"{lapsed}; the lease was given up")

    def renew(self) -> None:
        """Rewrite the record with a new time if it is still this writer's, or take it again
        if it is free (deleted meanwhile): conditional writes only.

        Raises:
            FileExistsError: another writer holds it (:attr:`lost` says so from then on).
            StorageError: the store cannot be read or written (retried by the heartbeat).
        """
        with self._renewing:
            if self.lost is not None:
                raise FileExistsError(self.lost)
            if self._stop.is_set():
                return  # released: the record is deleted, not renewed
            started = time.monotonic()
            lapsed = self.lapsed
            doc = dict(self.doc, renewed=time.time())
            data = json.dumps(doc).encode()
            try:
                etag = self._write(data, doc["session"])
            except FileExistsError:
                raise
            except Exception as e:
                self.last_error = f"{type(e).__name__}: {e}"
                raise
            self.etag, self.doc, self.renewed, self.last_error = etag, doc, started, None
            if lapsed is not None:
                self.generation += 1
        if lapsed is not None:
            logger.warning(
                "coci: the lease of %s is this writer's again (%s); writing there resumes",
                self.storage.url,
                lapsed,
            )

    def _write(self, data: bytes, session: str) -> str | None:
        """Put the record if it is unchanged since the last renewal (If-Match on its ETag),
        else see :meth:`_take_again`; the new ETag."""
        if self.etag is not None:
            with contextlib.suppress(FileExistsError):
                etag: str | None = self.storage.put_record(LEASE_NAME, data, if_match=self.etag)
                return etag
        return self._take_again(data, session)

    def _take_again(self, data: bytes, session: str) -> str | None:
        """The record changed since this writer's last renewal (or the store has no ETags):
        write it again if it is still this writer's (a renewal whose answer was lost) or free.

        Raises:
            FileExistsError: another writer's record is there, or won a race for it.
        """
        current = self.storage.read_record(LEASE_NAME)
        etag: str | None
        try:
            if current is None:
                etag = self.storage.put_record(LEASE_NAME, data, if_absent=True)
                return etag
            if _session_of(current[0]) == session:
                etag = self.storage.put_record(LEASE_NAME, data, if_match=current[1])
                return etag
        except FileExistsError:
            pass
        self.lost = f"another writer took over {self.storage.url}"
        raise FileExistsError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self.lapsed is not None:
            return  # not known to be this writer's: it may be another writer's by now
        # Delete the record only while it is still this writer's. Best effort, and never an
        # error (this runs from close(), finalizers and at exit, when the store may be gone):
        # a record left behind expires after its TTL.
        try:
            current = self.storage.read_record(LEASE_NAME)
            if current is not None and _session_of(current[0]) == self.doc["session"]:
                self.storage.remove_record(LEASE_NAME)
        except Exception as e:  # any client error: botocore's are not OSErrors
            logger.info("coci: could not remove the lease record of %s: %s", self.storage.url, e)


def _forget_in_child() -> None:
    """In a forked child (a data loader's worker, say): the parent's leases are not the
    child's. Their inherited descriptors are closed: a ``flock`` belongs to the open file
    description, which a child shares, so a worker that outlived a killed writer would
    otherwise keep the directory locked. Releasing them later does nothing (no record of the
    parent's is removed, no descriptor number the child reused is closed)."""
    global _HELD_LOCK
    _HELD_LOCK = threading.RLock()  # another thread of the parent may have held it at the fork
    for lease in list(_LEASES):
        fd, lease._fd, lease._released = lease._fd, None, True
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _LEASES.clear()
    _HELD.clear()


def _before_fork() -> None:
    # No lease is half made or half released in the child: acquire_lease and release hold it.
    _HELD_LOCK.acquire()


def _after_fork_in_parent() -> None:
    _HELD_LOCK.release()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forget_in_child
)


def _parsed(record: bytes | str) -> dict[str, Any]:
    """A lease record's fields; empty when it is not a JSON object (damaged, forged, nested
    beyond what the parser follows)."""
    try:
        doc = json.loads(record)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _session_of(record: bytes) -> str | None:
    session = _parsed(record).get("session")
    return session if isinstance(session, str) else None


def _expiry(record: dict[str, Any]) -> float:
    """When a lease record expires unless renewed; 0 (stale) for one that no writer makes: not
    numbers, not finite, a time to live beyond ``MAX_LEASE_TTL_S`` or a renewal more than that
    ahead of this clock (a clock that runs minutes ahead is waited for, as a live writer)."""
    try:
        renewed, ttl = float(record["renewed"]), float(record["ttl"])
    except (ValueError, KeyError, TypeError, OverflowError):
        return 0.0
    now = time.time()
    if not (math.isfinite(renewed) and 0.0 < ttl <= MAX_LEASE_TTL_S):
        return 0.0
    if renewed > now + MAX_LEASE_TTL_S:
        return 0.0
    return renewed + ttl


def _take_owner_record(store: RecordStore, doc: dict[str, Any], key: str) -> _OwnerRecord:
    data = json.dumps(doc).encode()
    try:
        etag = store.put_record(LEASE_NAME, data, if_absent=True)
    except FileExistsError:
        current = store.read_record(LEASE_NAME)
        held = current[0].decode("utf-8", "replace") if current else ""
        theirs = _parsed(held)
        expires = _expiry(theirs)  # 0 when unreadable: nobody can renew it
        if current is not None and expires > time.time() and not _died_here(theirs):
            raise DirectoryInUseError(
                f"another coci writer ({_holder_text(held)}) is writing to {key} (its lease "
                f"expires in {expires - time.time():.0f}s unless renewed): wait for it to "
                "finish, or give each run its own directory"
            ) from None
        if current is not None:
            logger.warning(
                "coci: taking over the stale lease of %s (%s stopped renewing it)",
                key,
                _holder_text(held),
            )
        try:
            if current is None:
                etag = store.put_record(LEASE_NAME, data, if_absent=True)
            else:
                # If-Match on the stale record's ETag: of two writers taking it over, one wins.
                etag = store.put_record(LEASE_NAME, data, if_match=current[1])
        except FileExistsError:
            raise DirectoryInUseError(
                f"another coci writer took the lease of {key} first: give each run its own "
                "directory"
            ) from None
    return _OwnerRecord(store, doc, etag, float(doc["ttl"]))


def _machine() -> str:
    """This boot of this machine and this PID namespace: where a PID names one process."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            if path.endswith("boot_id"):
                with open(path) as f:
                    parts.append(f.read().strip())
            else:
                parts.append(os.readlink(path))
        except OSError:
            return ""  # unknown: never judge another process dead
    return f"{socket.gethostname()}|{'|'.join(parts)}"


def _died_here(record: Any) -> bool:
    """True when the record's writer ran on this machine, in this PID namespace, since its
    last boot, and its process is gone (a crash restarted on the same node need not wait for
    the lease time)."""
    try:
        if not record["machine"] or record["machine"] != _machine():
            return False
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return False
    # no process has a PID outside (0, 2**22] (Linux's pid_max); 0 and -1 would ask a group
    if not 0 < pid <= 1 << 22 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive (another user's process) or unknown
    return False


def _holder_text(info: str) -> str:
    doc = _parsed(info)
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return f"process {int(doc['pid'])} on {str(doc['host'])[:64]} since {since}"
    except (ValueError, KeyError, TypeError, OverflowError):
        return "another process"


def acquire_lease(storage: Storage, session: str) -> Lease:
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
        root = storage.local_root()
        fd = None
        if root is not None:
            path = os.path.join(root, LEASE_NAME)
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as e:
                raise StorageError.wrap(f"cannot create the lease file {path}: {e}", e) from e
            try:
                fd = open_own_file(path, os.O_RDWR)
            except StorageError as e:
                raise StorageError.wrap(f"the writer's lease file: {e}", e) from e
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
            with contextlib.suppress(OSError):  # written, then cut: never read empty
                written = os.pwrite(fd, info.encode(), 0)
                os.ftruncate(fd, written)
        remote = None
        store = storage.record_store() if root is None else None
        if store is not None:
            doc = dict(json.loads(info), renewed=time.time(), ttl=LEASE_TTL_S, machine=_machine())
            remote = _take_owner_record(store, doc, key)
        _HELD[key] = info
        return Lease(key, fd, remote)  # registered under the lock: see _forget_in_child
