"""Whether a file's bytes are in the page cache (``mincore`` on a mapping that is never touched).

A restore drops the pages it read so that a checkpoint read once does not evict what training
reads; pages that were cached before it read them (a checkpoint just written, or read by another
process) are left where they were: this module tells the two apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

__all__ = ["all_cached"]

_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None  # mincore's vector differs elsewhere; dropping stays the rule there
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def all_cached(fd: int, offset: int, length: int) -> bool:
    """True if every page of ``length`` bytes of the file ``fd`` from ``offset`` is in the page
    cache now; False if one is not, or if that cannot be told (no ``mincore``, a file system
    that cannot be mapped)."""
    if _LIBC is None or length <= 0:
        return False
    start = offset - offset % _PAGE
    span = offset + length - start
    addr = _LIBC.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == _MAP_FAILED:
        return False
    try:
        pages = (span + _PAGE - 1) // _PAGE
        vec = ctypes.create_string_buffer(pages)
        if _LIBC.mincore(addr, span, vec) != 0:
            return False
        # Each byte's lowest bit: that page is resident (the other bits are reserved).
        raw = vec.raw
        return raw.count(b"\x01") == pages or all(b & 1 for b in raw)
    finally:
        _LIBC.munmap(addr, span)
