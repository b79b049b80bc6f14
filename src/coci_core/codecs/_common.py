"""Shared pieces of the array codecs: the result type, parameter checks, buffers, containers.

Every stored blob written by an array codec is a *section container*::

    b"COCI" | u32 nsections | nsections x u64 length | section 0 | section 1 | ...

(little endian). Its size must match exactly; anything else is a CorruptCheckpointError.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from coci_core.errors import ConfigError, CorruptCheckpointError

JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None
Params: TypeAlias = dict[str, JSON]
Buffer: TypeAlias = memoryview | bytes | bytearray | npt.NDArray[Any]
U8: TypeAlias = npt.NDArray[np.uint8]

_MAGIC = b"COCI"
_HEAD = struct.Struct("<4sI")

FLOAT_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Encoded:
    """What an encoder returns: the bytes to store and the JSON-able parameters to record.

    ``hashes`` is set by the chunk-incremental codec only: the packed chunk hashes of the data,
    to pass as ``base_hashes`` when the next checkpoint of the same piece is encoded.
    """

    data: bytes | memoryview
    params: Params
    hashes: bytes | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Stored size in bytes."""
        return memoryview(self.data).nbytes


def u8(data: Buffer) -> U8:
    """A flat uint8 view of ``data`` (no copy when it is contiguous)."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8)
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ConfigError("codec input must be a contiguous buffer")
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8)


def writable_u8(out: Buffer) -> U8:
    """A flat, writable uint8 view of the output buffer."""
    arr = u8(out)
    if not arr.flags.writeable:
        raise ConfigError("codec output buffer is read-only")
    return arr


def dtype_name(dtype: str | torch.dtype) -> str:
    """``"float32"`` for ``torch.float32`` or ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def itemsize_of(dtype: str | torch.dtype) -> int:
    """The element size of a torch dtype (or its manifest name); 1 for unknown byte types."""
    name = dtype_name(dtype)
    if name in FLOAT_DTYPES:
        return FLOAT_DTYPES[name]
    t = getattr(torch, name, None) if name.isidentifier() else None
    if isinstance(t, torch.dtype):
        return int(t.itemsize)
    raise ConfigError(f"unknown dtype {name!r}")


def xxh128(data: Buffer) -> str:
    """Hex XXH3-128 of ``data`` (used to check that a decoder was given the right base)."""
    return xxhash.xxh3_128_hexdigest(u8(data).data)


# --- section container ------------------------------------------------------------------


def pack_sections(sections: Sequence[Buffer]) -> bytes:
    """One blob holding ``sections`` (see the module docstring)."""
    views = [u8(s).data for s in sections]
    head = _HEAD.pack(_MAGIC, len(views)) + struct.pack(
        f"<{len(views)}Q", *(v.nbytes for v in views)
    )
    return b"".join([head, *views])


def unpack_sections(blob: Buffer, count: int | None = None) -> list[memoryview]:
    """The sections of a blob made by :func:`pack_sections`; checks magic, count and sizes."""
    mv = u8(blob).data
    if mv.nbytes < _HEAD.size:
        raise CorruptCheckpointError(f"stored piece is too short ({mv.nbytes} bytes)")
    magic, n = _HEAD.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise CorruptCheckpointError("stored piece has a bad header")
    if (count is not None and n != count) or n > (mv.nbytes - _HEAD.size) // 8:
        raise CorruptCheckpointError(f"stored piece has {n} sections, expected {count}")
    lengths = struct.unpack_from(f"<{n}Q", mv, _HEAD.size)
    pos = _HEAD.size + 8 * n
    if pos + sum(lengths) != mv.nbytes:
        raise CorruptCheckpointError(
            f"stored piece has {mv.nbytes} bytes, its header says {pos + sum(lengths)}"
        )
    out = []
    for length in lengths:
        out.append(mv[pos : pos + length])
        pos += length
    return out


# --- a small shared pool for codecs that split work (zstandard releases the GIL) ----------

_T = TypeVar("_T")
_R = TypeVar("_R")
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pmap(fn: Callable[[_T], _R], items: Iterable[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]``, on up to ``threads`` threads (in order)."""
    jobs = list(items)
    if threads <= 1 or len(jobs) <= 1:
        return [fn(x) for x in jobs]
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="coci-codec")
    return list(pool.map(fn, jobs))


@dataclass
class QuantState:
    """What the caller keeps per piece between lossy saves (one copy of the piece's bytes).

    ``reset(data, step)`` after the piece was saved losslessly (a new base); ``encode_quantized``
    computes the new reconstruction and holds it as pending; ``commit()`` once that checkpoint
    is durable makes it the reference for the next save (skip it if the save failed: the next
    delta is then taken against the last durable one).
    """

    ref: U8 | None = field(default=None, repr=False)
    ref_step: int | None = None
    generation: int = 0  # lossy saves since the last lossless base
    _pending: tuple[U8, int | None] | None = field(default=None, repr=False)

    def reset(self, data: Buffer, step: int | None = None) -> None:
        """The piece was stored exactly (at ``step``): it is the reference from now on."""
        self.ref = u8(data).copy()
        self.ref_step = step
        self.generation = 0
        self._pending = None

    def commit(self) -> None:
        """The last encoded save is durable: its reconstruction is the next reference."""
        if self._pending is None:
            raise ConfigError("nothing to commit: no quantized encode since the last commit")
        self.ref, self.ref_step = self._pending
        self.generation += 1
        self._pending = None
