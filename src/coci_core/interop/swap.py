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
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from coci_core.errors import CociError, ConfigError

__all__ = ["EXPORT_MARKS", "directory_beside", "swap_in"]

#: the file each directory format writes, by which an OUT that holds files is known as an
#: earlier export (and may be replaced); a directory without it is refused, never replaced
EXPORT_MARKS = {"dcp": "coci_export.json", "transformers": "trainer_state.json"}


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
    mark = EXPORT_MARKS[fmt]
    if out.is_dir() and any(out.iterdir()) and not os.path.lexists(out / mark):
        raise ConfigError(
            f"{out} holds files and is not an earlier coci export (no {mark}): "
            f"--format {fmt} replaces the directory whole; give a new or empty one"
        )
    try:
        tmp = _new_directory_beside(out)
    except OSError as e:  # a place no directory can be made (procfs), a full disk
        raise CociError(f"cannot write {out}: {e.strerror or e}") from e
    try:
        yield tmp
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
