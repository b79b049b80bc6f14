"""A package of one's own, as another project would write it: a ``mem2://`` storage backend and
a zlib codec, declared as entry points (``coci.storage``, ``coci.codecs``) and never imported by
coci by name. ``tests/storage/test_installed_plugins.py`` copies this file onto a temporary path
as ``coci_mem2_plugin`` beside its ``dist-info`` directory.

``mem2://<name>`` keeps its files in a directory of ``$COCI_MEM2_ROOT`` (so that another process,
such as the ``coci`` command, sees the same store).
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from coci_core.codecs import Codec, EncodeArgs, Encoded, Params
from coci_core.codecs._common import Buffer, u8, writable_u8
from coci_core.codecs._params import check_codec, check_out
from coci_core.errors import CorruptCheckpointError, StorageError
from coci_core.storage import Storage

ZLIB_NAME = "mem2plugin.zlib/1"


class Mem2Storage(Storage):
    """Files in a directory named after the URL; only the required operations."""

    renames = True

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.root = Path(os.environ["COCI_MEM2_ROOT"]) / url.split("://", 1)[1].strip("/")
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, path: str) -> Path:
        return self.root / path if path else self.root

    def list_dir(self, path: str = "") -> list[str]:
        where = self._path(path)
        return sorted(os.listdir(where)) if where.is_dir() else []

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        with open(target, "wb") as f:
            for chunk in chunks:
                written += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return written

    def read_bytes(self, path: str) -> bytes:
        try:
            return self._path(path).read_bytes()
        except OSError as e:
            raise StorageError(f"{self.url}/{path}: {e}") from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        data = self.read_bytes(path)[offset : offset + len(view)]
        if len(data) < len(view):
            raise StorageError(f"{self.url}/{path} is shorter than expected")
        view[:] = data

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(self._path(path), ignore_errors=True)

    def publish(self, staging: str, final: str) -> None:
        """Rename the staged directory into place; a step saved again is swapped aside first
        (a crash between the two renames leaves the new step staged, the old one aside)."""
        src, dst = self._path(staging), self._path(final)
        if dst.exists():
            aside = self._path(f"{staging}.old")
            os.rename(dst, aside)
            os.rename(src, dst)
            shutil.rmtree(aside)
        else:
            os.rename(src, dst)


def _encode_zlib(data: memoryview, args: EncodeArgs) -> Encoded:
    raw = u8(data)
    return Encoded(zlib.compress(raw.tobytes(), 6), {"codec": ZLIB_NAME, "nbytes": raw.nbytes})


def _decode_zlib(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    check_codec(params, ZLIB_NAME)
    dst = writable_u8(out)
    size = check_out(params, dst)
    try:
        data = zlib.decompressobj().decompress(u8(stored).tobytes(), size)
    except zlib.error as e:
        raise CorruptCheckpointError(f"zlib piece does not decompress: {e}") from e
    if len(data) != size:
        raise CorruptCheckpointError(f"zlib piece has {len(data)} bytes, expected {size}")
    dst[:] = np.frombuffer(data, dtype=np.uint8)


#: float32 pieces under ``compression="lossless"`` are written with zlib.
ZLIB = Codec(
    ZLIB_NAME,
    _decode_zlib,
    _encode_zlib,
    select=lambda dtype, nbytes, mode, base: dtype == "float32" and mode == "lossless",
)
