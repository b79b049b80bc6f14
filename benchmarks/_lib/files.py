"""Scratch files and directories, durability and the page cache."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from pathlib import Path


def drop_file_cache(path: Path) -> None:
    """Evict a file's (clean) pages from the page cache; directories are walked."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:  # retired meanwhile (another rank's retention)
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_file_cache(path: Path) -> None:
    """Bring every page of a file (directories are walked) into the page cache by reading it
    through once."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    buf = bytearray(16 << 20)
    for p in paths:
        try:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        except FileNotFoundError:
            continue


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rm(path: Path) -> None:
    """Remove a file or a directory tree; missing is fine."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def clean(path: Path) -> None:
    """Remove a directory tree and ``sync``, so its writeback does not land in what follows."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def dir_bytes(path: Path, prefix: str = "") -> int:
    """Bytes of the files below ``path`` whose names start with ``prefix`` (0 if missing)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob(f"{prefix}*") if f.is_file())


def free() -> None:
    """Collect garbage and give freed heap memory back to the system."""
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def scratch(given: str | None, name: str) -> str:
    """The scratch directory a benchmark writes under: ``given`` (``--dir``), else a new
    temporary directory (``coci-<name>-*`` under the system's temporary directory)."""
    return given if given is not None else tempfile.mkdtemp(prefix=f"coci-{name}-")
