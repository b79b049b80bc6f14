"""An export directory written beside its place and swapped in whole, for every format that
writes a directory (``--format dcp``, ``--format transformers``): an export killed midway, or
two at once of different steps, leave OUT one whole export, never one step's files under
another's note or beside another step's files. (A ``.pt`` or ``.safetensors`` file is written
beside and renamed over OUT: :func:`coci_core.interop.weights.temp_beside`.)"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from coci_core.errors import CociError, ConfigError

__all__ = ["EXPORT_MARKS", "directory_beside", "not_an_earlier_export", "swap_in"]

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

    Raises:
        ConfigError: ``out`` holds files and is not an earlier export of ``fmt``.
        CociError: no directory can be made beside ``out``.
        OSError: the swap failed.
    """
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
        tmp = _new_directory_beside(out)
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


def _new_directory_beside(out: Path) -> Path:
    """A new directory of a name no other has beside ``out``, made as ``mkdir`` makes one
    (the umask's mode, as OUT made in place had: ``mkdtemp``'s is 0700)."""
    for _ in range(100):
        name = out.parent / f".{out.name}.{secrets.token_hex(6)}.coci-tmp"
        try:
            name.mkdir()
        except FileExistsError:
            continue
        return name
    raise FileExistsError(errno.EEXIST, "no free name for a directory beside it", str(out))


def swap_in(new: Path, out: Path) -> None:
    """Put the directory ``new`` at ``out`` in one step; an ``out`` that was there ends at
    ``new`` (for the caller to remove). Linux's ``renameat2(RENAME_EXCHANGE)`` swaps the two
    whole; where it is missing, ``out`` is moved aside first (a kill between the two renames
    leaves the earlier export whole beside it, named ``.OUT.*.coci-tmp``)."""
    try:
        os.rename(new, out)  # no OUT yet (or an empty one): the new one takes its name
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
        if renameat2(at_cwd, os.fsencode(new), at_cwd, os.fsencode(out), exchange) == 0:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):  # unsupported: move aside
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(out))
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".coci-tmp", dir=out.parent))
    os.rename(out, aside / "old")
    os.rename(new, out)
    os.rename(aside, new)


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
