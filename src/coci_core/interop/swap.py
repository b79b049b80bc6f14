"""An export written beside its place and put there whole: a directory (``--format dcp``,
``--format transformers``) is swapped in, a ``.pt`` or ``.safetensors`` file renamed over OUT.
An export killed midway, or two at once of different steps, leave OUT one whole export, never
one step's files under another's note or beside another step's files.

The directory or file beside OUT, ``.OUT.<12 hex digits>.coci-tmp``, is held under an
advisory lock (``flock``) while its export lives; an export killed midway leaves it unlocked,
and the next export to the same OUT removes it (after putting back an earlier export that a
kill left moved aside: :func:`remove_leftovers`): a directory export the directories, a file
export the files."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from coci_core.errors import CociError, ConfigError

__all__ = [
    "EXPORT_MARKS",
    "directory_beside",
    "file_beside",
    "not_an_earlier_export",
    "remove_leftovers",
    "swap_in",
]

#: the name of a directory or file beside OUT that an export writes (or moves OUT aside into)
_BESIDE = re.compile(r"\.(?P<out>.+)\.[0-9a-f]{12}\.coci-tmp")

#: False: :func:`swap_in` takes the two renames of a system without ``renameat2`` (tests)
_EXCHANGE = True

#: the file each directory format writes, by which an OUT that holds files is known as an
#: earlier export (and may be replaced); a directory without it is refused, never replaced
EXPORT_MARKS = {"dcp": "coci_export.json", "transformers": "trainer_state.json"}

#: the only names an earlier ``--format transformers`` export holds: a Trainer's own
#: ``checkpoint-N`` (``training_args.bin``, a tokenizer's files) is not replaced whole
_TRANSFORMERS_NAMES = re.compile(
    r"(model\.safetensors|config\.json|trainer_state\.json|optimizer\.pt|scheduler\.pt"
    r"|scaler\.pt|rng_state(_\d+)?\.pth)"
)


def not_an_earlier_export(out: Path, fmt: str) -> str | None:
    """Why the existing directory ``out`` may not be replaced whole by an export of ``fmt``
    (it holds files and is no earlier export of that format), or None."""
    names = [entry.name for entry in out.iterdir()]
    mark = EXPORT_MARKS[fmt]
    if not names:
        return None
    marked = out / mark
    if mark not in names or marked.is_symlink():  # a link: anyone's file, named so
        return f"{out} holds files and is not an earlier coci export (no {mark} of its own)"
    if fmt == "transformers":
        others = sorted(n for n in names if not _TRANSFORMERS_NAMES.fullmatch(n))
        if others:
            return (
                f"{out} holds files a coci export does not write ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''})"
            )
    return None


@contextlib.contextmanager
def directory_beside(out: Path, fmt: str) -> Iterator[Path]:
    """A new, empty directory beside ``out`` to write the export of format ``fmt`` into; when
    the block ends without an error it is swapped in at ``out`` whole, and what was at ``out``
    is removed. On an error ``out`` is left as it was.

    Leftovers of earlier exports to ``out`` that were killed are removed first
    (:func:`remove_leftovers`).

    Raises:
        ConfigError: ``out`` holds files and is not an earlier export of ``fmt``.
        CociError: no directory can be made beside ``out``.
        OSError: the swap failed.
    """
    remove_leftovers(out, fmt)
    why = not_an_earlier_export(out, fmt) if out.is_dir() else None
    if why is not None:
        raise ConfigError(
            f"{why}: --format {fmt} replaces the directory whole; give a new or empty one"
        )
    out = Path(os.path.abspath(out))  # "." has no name to write beside
    # the working directory (a shell left in a removed one) and a mount point (EBUSY) are
    # written into in place
    in_place = out.is_dir() and (os.path.ismount(out) or os.path.samefile(out, os.getcwd()))
    try:
        tmp, lock = _new_beside(out, directory=True)
    except OSError as e:  # a place no directory can be made (procfs), a full disk
        raise CociError(f"cannot write {out}: {e.strerror or e}") from e
    try:
        yield tmp
        with contextlib.suppress(OSError):  # the mode of the OUT it replaces (none: the umask's)
            os.chmod(tmp, stat.S_IMODE(out.stat().st_mode))
        if in_place:
            _move_into(tmp, out)
        else:
            swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # this export's, or the one it replaced
        os.close(lock)


@contextlib.contextmanager
def file_beside(out: Path) -> Iterator[Path]:
    """A new, empty file beside ``out`` (of a name no other has, made exclusively: a link
    planted at a name chosen in advance would send the write to its target), locked while the
    block runs, for the block to write and rename over ``out``; removed at the end if it is
    still there. Leftovers of earlier file exports to ``out`` that were killed are removed
    first (:func:`remove_leftovers`).

    Raises:
        CociError: no file can be made there.
    """
    out = Path(os.path.abspath(out))
    remove_leftovers(out, None)
    try:
        tmp, lock = _new_beside(out, directory=False)
    except OSError as e:  # a place no file can be made (procfs), a full disk
        raise CociError(f"cannot write {out}: {e.strerror or e}") from e
    try:
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # still there: the export failed
        os.close(lock)


def _new_beside(out: Path, *, directory: bool) -> tuple[Path, int]:
    """A new directory (or empty file) of a name no other has beside ``out``, made as
    ``mkdir`` makes one (the umask's mode, as OUT made in place had: ``mkdtemp``'s is 0700; a
    file 0600, as ``mkstemp`` makes it), and a descriptor of it that holds its lock (closing
    it lets :func:`remove_leftovers` remove it)."""
    for _ in range(100):
        name = out.parent / f".{out.name}.{secrets.token_hex(6)}.coci-tmp"
        try:
            if not directory:  # made and opened in one step (never through a planted link)
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            else:
                name.mkdir()
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except (FileExistsError, FileNotFoundError):  # taken; removed before its lock
            continue
        # waits out another export's removal of it, if any; a file system without locks
        # (ENOLCK): no export removes one there either
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _same(fd, name):
            return name, fd
        os.close(fd)  # removed as a leftover between its making and the lock: another name
    raise FileExistsError(errno.EEXIST, "no free name beside it", str(out))


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the directory (or file) ``fd`` was opened on."""
    try:
        here = path.lstat()
    except FileNotFoundError:
        return False
    there = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def remove_leftovers(out: Path, fmt: str | None) -> list[Path]:
    """Remove the directories beside ``out`` that exports of the directory format ``fmt`` to
    ``out`` killed midway left (``.OUT.<12 hex digits>.coci-tmp``, unlocked: one a live export
    holds is left to it), or with ``fmt`` None the regular files of that name that killed
    ``.pt`` or ``.safetensors`` exports left (:func:`file_beside`); the ones removed. Where
    ``out`` is missing and a leftover directory holds the earlier export of ``fmt`` that a
    kill between :func:`swap_in`'s two renames left moved aside (its ``old``), that export is
    put back at ``out`` first; one whose ``old`` is anything else (another format's export) is
    left as it is. Nothing else beside ``out`` is touched; a leftover that cannot be removed
    (another user's) is left."""
    out = Path(os.path.abspath(out))
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:
        return []
    removed = []
    for name in names:
        match = _BESIDE.fullmatch(name)
        if match is None or match["out"] != out.name:
            continue
        path = out.parent / name
        kind = os.O_DIRECTORY if fmt is not None else os.O_NONBLOCK  # a FIFO: no waiting
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | kind)
        except OSError:  # gone, a link, a file of that name: not an export's
            continue
        try:
            if fmt is None and not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a directory export's, a FIFO, a device: not a file export's
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _same(fd, path):
                continue
            if fmt is None:
                os.unlink(path)
                removed.append(path)
                continue
            old = path / "old"
            if not os.path.lexists(out) and os.path.lexists(old):
                if not _an_export(old, fmt):
                    continue  # what was at OUT, not this format's export: left, never removed
                os.rename(old, out)  # the earlier export, whole, back in its place
            shutil.rmtree(path)
            removed.append(path)
        except OSError:  # a live export's (locked), or one that cannot be removed
            continue
        finally:
            os.close(fd)
    return removed


def _an_export(path: Path, fmt: str) -> bool:
    """Whether ``path`` is a directory of an export of ``fmt`` (not empty, not a link)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return any(path.iterdir()) and not_an_earlier_export(path, fmt) is None


def swap_in(new: Path, out: Path) -> None:
    """Put the directory ``new`` at ``out`` in one step; an ``out`` that was there ends at
    ``new`` (for the caller to remove). Linux's ``renameat2(RENAME_EXCHANGE)`` swaps the two
    whole; where it is missing, :func:`_swap_by_renames`."""
    try:
        os.rename(new, out)  # no OUT yet (or an empty one): the new one takes its name
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if not (_EXCHANGE and _exchange(new, out)):
        _swap_by_renames(new, out)


def _exchange(new: Path, out: Path) -> bool:
    """Swap ``new`` and ``out`` with ``renameat2(RENAME_EXCHANGE)``; False where the system or
    file system has none."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(new), at_cwd, os.fsencode(out), exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):  # unsupported: move aside
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(out))


def _swap_by_renames(new: Path, out: Path) -> None:
    """:func:`swap_in` in two renames: ``out`` moved into a locked directory beside it (as
    ``old``), then ``new`` renamed to ``out``. A kill between them leaves no ``out``, the
    earlier export whole in that directory, which the next export puts back before it removes
    the leftovers (:func:`remove_leftovers`); a failed second rename puts it back at once."""
    aside, lock = _new_beside(out, directory=True)
    try:
        os.rename(out, aside / "old")
        try:
            os.rename(new, out)
        except OSError:
            with contextlib.suppress(OSError):
                os.rename(aside / "old", out)
            raise
        os.rename(aside, new)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(aside)  # only when empty: never the earlier export it may hold
        raise
    finally:
        os.close(lock)


def _move_into(new: Path, out: Path) -> None:
    """Put ``new``'s entries into ``out`` in place of ``out``'s own, for an ``out`` that is not
    to be renamed (the working directory, a mount point): not in one step."""
    for entry in list(out.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in list(new.iterdir()):
        shutil.move(entry, out / entry.name)  # a mount point is another file system
