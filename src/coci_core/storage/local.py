"""Local files: direct I/O from aligned buffers where the file system allows, fsync, rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from coci_core.errors import StorageError
from coci_core.knobs import CACHED_READ_BYTES, SYNC_EVERY_BYTES
from coci_core.storage.base import Storage
from coci_core.storage.pagecache import all_cached

__all__ = ["LocalStorage", "open_regular"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
# read_chunks drops what it read from the page cache (False: benchmarks/restore_bench.py)
DROP_READ_PAGES = True


class LocalStorage(Storage):
    """A directory on a local file system.

    Checkpoints are written into ``<step>.coci-tmp-<token>`` and published with an atomic
    rename followed by an fsync of the parent directory. Declares every optional capability
    but a record store (the lease is an ``flock`` in :meth:`local_root`).
    """

    renames = True
    # the descriptors of the read sessions open now (see read_session), by file
    _read_fds: dict[Path, _Lent] = {}  # noqa: RUF012 - replaced, never changed, on the class
    _read_sessions = 0
    _read_pid = -1  # the process whose sessions these are
    _read_lock = threading.Lock()

    def __init__(self, root: str | os.PathLike[str], *, direct_io: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.direct_io = direct_io and bool(_O_DIRECT)
        self.exchange = True  # swap directories atomically on re-save where possible

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def _path(self, path: str) -> Path:
        return self.root / path if path else self.root

    def list_dir(self, path: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(path)))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"cannot list {self._path(path)}: {e}") from e

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        target = self._path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, direct = self._open_for_write(target, direct=aligned and self.direct_io)
            try:
                written = unsynced = 0
                for chunk in chunks:
                    n = _write_all(fd, chunk)
                    written += n
                    unsynced += n
                    if not direct and unsynced >= SYNC_EVERY_BYTES:
                        # Push buffered bytes to the disk now, while the producer of the next
                        # chunk (an encoder) works, instead of all at once in the final fsync.
                        os.fdatasync(fd)
                        unsynced = 0
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise StorageError.wrap(f"cannot write {target}: {e.strerror or e}", e) from e
        return written

    def _open_for_write(self, target: Path, *, direct: bool) -> tuple[int, bool]:
        """The file descriptor, and whether it writes with direct I/O."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if direct:
            try:
                return os.open(target, flags | _O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O
                    raise
        return os.open(target, flags, 0o644), False

    def size(self, path: str) -> int:
        """The size of the regular file at ``path`` (a FIFO, a device or a directory is
        refused: reading one could block or never end)."""
        target = self._path(path)
        try:
            st = os.stat(target)
        except (OSError, ValueError) as e:
            raise StorageError.wrap(f"cannot read {target}: {e}", e) from e
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"cannot read {target}: not a regular file")
        return st.st_size

    def read_bytes(self, path: str) -> bytes:
        target = self._path(path)
        try:
            with open(open_regular(target), "rb") as f:
                return f.read()
        except StorageError:
            raise
        except (OSError, ValueError) as e:
            raise StorageError.wrap(f"cannot read {target}: {e}", e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        target = self._path(path)
        view = out.cast("B")
        try:
            fd, done, _ = self._open_read(target)
            try:
                size = os.fstat(fd).st_size
                if offset + len(view) > size:
                    raise StorageError(
                        f"{target} is shorter than expected: needed {len(view)} bytes at "
                        f"offset {offset}, it has {size}"
                    )
                _read_exactly(fd, offset, view, target)
            finally:
                done()
        except StorageError:
            raise
        except (OSError, ValueError, OverflowError) as e:
            raise StorageError.wrap(f"cannot read {target}: {e}", e) from e

    @contextlib.contextmanager
    def read_session(self) -> Iterator[None]:
        """Within it, the reads of one file share one descriptor, opened at the first read and
        closed at the end (once no read holds it): the kernel's read-ahead then follows a
        restore through each data file (a new descriptor per piece starts without it:
        measured 1.3x slower cold). A descriptor is lent only while its path still names the
        file it opened (a step saved again gets a new one), and at most
        :data:`SESSION_DESCRIPTORS` are kept (more files are opened per read)."""
        with self._read_lock:
            if self._read_pid != os.getpid():  # nothing of a parent's session is ours
                self._read_fds, self._read_sessions, self._read_pid = {}, 0, os.getpid()
            self._read_sessions += 1
        try:
            yield
        finally:
            with self._read_lock:
                self._read_sessions -= 1
                ended = self._read_fds if not self._read_sessions else {}
                if ended:
                    self._read_fds = {}
                for lent in ended.values():
                    lent.retire()

    def _open_read(self, target: Path) -> tuple[int, Callable[[], None], bool]:
        """A descriptor of ``target``, what to call once done with it, and whether the pages
        read stay in the page cache (the whole file was cached when the session opened it;
        outside a session: no)."""
        if not self._read_sessions or self._read_pid != os.getpid():
            fd = open_regular(target)
            return fd, functools.partial(os.close, fd), False
        try:
            now = os.stat(target)
        except OSError:
            now = None  # open_regular below says what is wrong
        with self._read_lock:
            fds = self._read_fds
            lent = fds.get(target) if self._read_sessions else None
            if lent is not None and (now is None or not lent.names(now)):
                del fds[target]
                lent.retire()
                lent = None
            if lent is None:
                if not self._read_sessions or len(fds) >= SESSION_DESCRIPTORS:
                    fd = open_regular(target)
                    return fd, functools.partial(os.close, fd), False
                lent = fds[target] = _Lent(open_regular(target))
            lent.holders += 1
        return lent.fd, functools.partial(self._give_back, lent), lent.keep

    def _give_back(self, lent: _Lent) -> None:
        with self._read_lock:
            lent.holders -= 1
            lent.close_if_done()

    @property
    def reads_in_chunks(self) -> bool:
        """True unless a subclass reads through its own ``read_into`` (which
        :meth:`read_chunks` would bypass)."""
        return type(self).read_into is LocalStorage.read_into

    def read_chunks(
        self, path: str, offset: int, out: memoryview, chunk_bytes: int
    ) -> Iterator[memoryview]:
        """Fill ``out`` from the file's byte ``offset`` in reads of ``chunk_bytes``, yielding
        each part of ``out`` once it is filled (to checksum it while the next one is read).

        The pages of each part are dropped from the page cache once read
        (``POSIX_FADV_DONTNEED``): a restore does not fill the cache with a checkpoint it reads
        once, evicting what training reads (measured faster than keeping them, and than
        ``O_DIRECT``; see docs/benchmarks.md). Within a :meth:`read_session`, a file that was
        wholly cached when the session first read it (just written, or read by another
        process) stays cached, copied in parts of :data:`~coci_core.knobs.CACHED_READ_BYTES`
        (each yielded); one that was not is dropped whole when the session ends (what the
        kernel read ahead too)."""
        target = self._path(path)
        view = out.cast("B")
        try:
            fd, done, keep = self._open_read(target)
            try:
                size = os.fstat(fd).st_size
                if offset + len(view) > size:
                    raise StorageError(
                        f"{target} is shorter than expected: needed {len(view)} bytes at "
                        f"offset {offset}, it has {size}"
                    )
                for start in range(0, len(view), chunk_bytes):
                    part = view[start : start + chunk_bytes]
                    if keep:
                        for sub in range(0, len(part), CACHED_READ_BYTES):
                            piece = part[sub : sub + CACHED_READ_BYTES]
                            _read_exactly(fd, offset + start + sub, piece, target)
                            yield piece
                        continue
                    _read_exactly(fd, offset + start, part, target)
                    if DROP_READ_PAGES:
                        os.posix_fadvise(fd, offset + start, len(part), os.POSIX_FADV_DONTNEED)
                    yield part
            finally:
                done()
        except StorageError:
            raise
        except (OSError, ValueError, OverflowError) as e:
            raise StorageError.wrap(f"cannot read {target}: {e}", e) from e

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(self._path(path), ignore_errors=True)

    def publish(self, staging: str, final: str) -> None:
        """Rename ``staging`` to ``final``. Re-saving a committed step swaps the two
        directories in one step (``renameat2(RENAME_EXCHANGE)``) where the kernel and file
        system allow; elsewhere the old one is first renamed to ``<final>.coci-old-<token>``,
        which the next manager renames back if a crash left ``final`` missing."""
        src, dst = self._path(staging), self._path(final)
        try:
            _fsync_dir(src)
            if dst.exists():
                if self.exchange and _rename_exchange(src, dst):
                    _fsync_dir(dst.parent)
                    shutil.rmtree(src, ignore_errors=True)  # now the old step
                    return
                aside = self._path(f"{final}.coci-old-{src.name.rsplit('-', 1)[-1]}")
                os.rename(dst, aside)
                os.rename(src, dst)
                _fsync_dir(dst.parent)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(src, dst)
            _fsync_dir(dst.parent)
        except OSError as e:
            raise StorageError.wrap(f"cannot publish {dst}: {e}", e) from e

    def retire(self, final: str) -> None:
        """Un-publish the committed step ``final`` in one rename, then delete its files (a
        crash in between leaves a ``.coci-del-`` directory, never a manifest without data)."""
        src = self._path(final)
        doomed = self._path(f"{final}.coci-del-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(src, doomed)
            _fsync_dir(src.parent)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError.wrap(f"cannot remove {src}: {e}", e) from e
        shutil.rmtree(doomed, ignore_errors=True)

    def free_bytes(self) -> int | None:
        """Free bytes on the file system that holds the directory (None: unknown)."""
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None

    def local_root(self) -> str:
        return str(self.root)


#: The most descriptors a read session keeps open (a restore of more data files opens the rest
#: per read): far below the usual limit of 1,024 descriptors a process.
SESSION_DESCRIPTORS = 64


class _Lent:
    """A descriptor a read session lends: closed once the session is over (or the path names
    another file) and no read holds it. Changed under ``LocalStorage._read_lock``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.file = (st.st_dev, st.st_ino)
        # decided before this session read anything of it: the kernel's read-ahead for the
        # session's own reads must not count as "cached before"
        self.keep = all_cached(fd, 0, st.st_size)
        self.holders = 0
        self.retired = False

    def names(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == self.file

    def retire(self) -> None:
        self.retired = True
        self.close_if_done()

    def close_if_done(self) -> None:
        if self.retired and not self.holders and self.fd >= 0:
            if not self.keep and DROP_READ_PAGES:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(self.fd)
            self.fd = -1


def _forget_sessions() -> None:
    """In a forked child: a lock another thread held stays held; the sessions are not ours."""
    LocalStorage._read_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_sessions)


def open_regular(target: str | os.PathLike[str], *, follow_links: bool = True) -> int:
    """A read-only descriptor of the regular file ``target``: opened without blocking (a FIFO
    would wait for a writer) and refused unless it is a regular file (a FIFO or a device such
    as /dev/zero, maybe through a symlink, could block or never end). With ``follow_links``
    off, a symbolic link is refused too.

    Raises:
        StorageError: it cannot be opened, or is not a regular file (or is a link).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        if os.path.islink(target):
            raise StorageError(f"cannot read {target}: a symbolic link, not a file")
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target, flags)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise StorageError.wrap(f"cannot open {target}: {e}", e) from e
    return _regular(fd, f"cannot read {target}: not a regular file")


def _regular(fd: int, refusal: str) -> int:
    """``fd`` when it is a regular file's; else it is closed and ``refusal`` raised."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError(refusal)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own_file(target: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """A descriptor of coci's own file ``target`` in a checkpoint directory (a lease, a
    telemetry file), created if absent, opened with ``flags`` (``os.O_RDWR``...): never through
    a symbolic link and never anything but a regular file, so that an entry planted in a
    shared directory cannot make coci truncate or write a file elsewhere.

    Raises:
        StorageError: naming ``target``: a link (symbolic, or a second name of another
            file), not a regular file, or not openable.
    """
    flags |= (
        os.O_CREAT
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    if os.path.islink(target):
        raise StorageError(f"{target} is a symbolic link, not coci's file: remove it")
    try:
        fd = os.open(target, flags, mode)
    except (OSError, ValueError) as e:  # ELOOP: a link planted since the check above
        raise StorageError.wrap(f"cannot open {target}: {e}", e) from e
    fd = _regular(fd, f"{target} is not a regular file, not coci's file: remove it")
    links = os.fstat(fd).st_nlink
    if links > 1:  # a hard link planted for it: writing would change the other name's file
        os.close(fd)
        raise StorageError(
            f"{target} has {links} names (hard links): coci writes only a file of its own "
            "there: remove it"
        )
    return fd


def _read_exactly(fd: int, offset: int, out: memoryview, target: Path) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if not n:
            raise StorageError(
                f"{target} is shorter than expected: ended at {offset + got}, needed "
                f"{len(out) - got} more bytes"
            )
        got += n


def _write_all(fd: int, chunk: memoryview) -> int:
    view = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
