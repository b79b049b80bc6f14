"""Which codec for which tensor, and whether compressing pays off in time to durable without
lengthening a restore.

The writer measures, these decide (consulting the codecs registered with a ``select``).
"""

from __future__ import annotations

import math

import torch

from coci_core.codecs._common import FLOAT_DTYPES, dtype_name
from coci_core.codecs.chunked import CHUNKS
from coci_core.codecs.lossless import LOSSLESS, XOR
from coci_core.codecs.quantized import QDELTA
from coci_core.codecs.registry import RAW, BaseAvailable, Mode, selected_codec
from coci_core.errors import ConfigError

__all__ = [
    "RAW",
    "BaseAvailable",
    "Mode",
    "choose_codec",
    "compression_pays",
    "time_to_durable",
    "time_to_restore",
]

MODES = ("none", "lossless", "lossy", "auto")

# Below this, zstd's frame overhead eats the gain (measured: tensors under ~1 KiB grow).
MIN_BYTES = 4096


def _check_positive(**values: float | None) -> None:
    """A ConfigError naming the first of ``values`` (None: not given) that is not a finite
    number above 0."""
    for name, value in values.items():
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < math.inf
        ):
            raise ConfigError(f"'{name}' must be a finite number above 0: {value!r}")


def time_to_durable(
    nbytes: int,
    *,
    write_mbps: float,
    encode_mbps: float | None = None,
    ratio: float = 1.0,
    pipelined: bool = False,
) -> float:
    """Seconds to encode and write ``nbytes`` (``encode_mbps=None``: written raw).

    Not pipelined (a writer that encodes a piece, then writes it, in one thread) the times add:
    ``n/encode + n/ratio/write``. Pipelined (piece i+1 encoded while piece i is written: coci's
    writer) the slower stage dominates: ``max(n/encode, n/ratio/write)``. MB/s are 1e6 B/s.
    """
    _check_positive(write_mbps=write_mbps, ratio=ratio, encode_mbps=encode_mbps)
    write = nbytes / (write_mbps * 1e6)
    if encode_mbps is None:
        return write
    enc = nbytes / (encode_mbps * 1e6)
    return max(enc, write / ratio) if pipelined else enc + write / ratio


def time_to_restore(
    nbytes: int,
    *,
    read_mbps: float,
    decode_mbps: float | None = None,
    ratio: float = 1.0,
    decodes: int = 1,
) -> float:
    """Seconds to read ``nbytes`` stored raw (``decode_mbps=None``), or stored compressed by
    ``ratio``, read and then decoded ``decodes`` times: ``n/ratio/read + decodes*n/decode`` (a
    restore reads a compressed piece, then decodes it; a delta between bases is decoded over
    its base's decoded bytes, ``decodes=2``, its own stored bytes taken as small next to the
    base's). MB/s are 1e6 B/s."""
    _check_positive(read_mbps=read_mbps, ratio=ratio, decode_mbps=decode_mbps)
    if type(decodes) is not int or decodes < 1:
        raise ConfigError(f"'decodes' must be an integer >= 1: {decodes!r}")
    read = nbytes / (read_mbps * 1e6)
    if decode_mbps is None:
        return read
    return read / ratio + decodes * nbytes / (decode_mbps * 1e6)


def compression_pays(
    *,
    encode_mbps: float,
    ratio: float,
    write_mbps: float,
    pipelined: bool = False,
    margin: float = 0.05,
    decode_mbps: float | None = None,
    read_mbps: float | None = None,
    deltas: bool = False,
) -> bool:
    """Whether compressing shortens the time to durable by more than ``margin`` (a fraction)
    and, given ``decode_mbps``, lengthens a restore by no more than ``margin``.

    Size-independent (every time is proportional to the bytes). ``margin`` keeps ``"auto"``
    from switching on noise: compression must win by 5% by default. ``read_mbps``: the
    storage's read speed (default: ``write_mbps``). ``deltas``: saves between bases are
    deltas, so a restore decodes a base and a delta (:func:`time_to_restore` with
    ``decodes=2``). A restore is what a resume waits for with every accelerator idle, so a
    compression that makes it slower does not pay even when the background write gets
    shorter.
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ConfigError(f"'margin' must be a number in [0, 1): {margin!r}")
    raw = time_to_durable(1_000_000, write_mbps=write_mbps)
    comp = time_to_durable(
        1_000_000, write_mbps=write_mbps, encode_mbps=encode_mbps, ratio=ratio, pipelined=pipelined
    )
    if not comp < raw * (1.0 - margin):
        return False
    if decode_mbps is None:
        return True
    read = write_mbps if read_mbps is None else read_mbps
    raw_restore = time_to_restore(1_000_000, read_mbps=read)
    comp_restore = time_to_restore(
        1_000_000, read_mbps=read, decode_mbps=decode_mbps, ratio=ratio, decodes=2 if deltas else 1
    )
    return comp_restore <= raw_restore * (1.0 + margin)


def choose_codec(
    dtype: str | torch.dtype,
    nbytes: int,
    mode: Mode,
    *,
    base: BaseAvailable = "none",
    compress_pays: bool = True,
    min_bytes: int = MIN_BYTES,
) -> str:
    """The codec name for one tensor piece.

    ``base`` says what the caller has of the same piece in the previous checkpoint: nothing,
    its chunk hashes (``coci.chunks/1`` possible), its bytes (``coci.xor-zstd/1`` possible) or a
    lossy reference (a :class:`QuantState` that was reset: ``coci.qdelta/1`` possible; it also
    means the bytes are available). ``compress_pays`` is :func:`compression_pays`'s verdict,
    used by ``"auto"`` only.

    - ``"none"``: raw. Pieces under ``min_bytes``: raw in every mode.
    - ``"lossless"``: float dtypes: XOR delta with base bytes, else shuffle + zstd (with hashes
      only: chunk-incremental with zstd inside). Other dtypes: chunk-incremental with hashes,
      else plain zstd (an XOR of integers compresses no better than the chunks).
    - ``"lossy"``: float dtypes with a reference: quantized delta; else as ``"lossless"``.
    - ``"auto"``: as ``"lossless"`` when it pays, else chunk-incremental when hashes are known
      (with ``compress=False``), else raw. (coci's writer does not call this for a save under
      ``"auto"`` that does not pay: it writes the arena raw, the fastest path.)

    Before these rules (and after the raw ones), a registered codec's ``select`` may pick it.
    """
    if mode not in MODES:
        raise ConfigError(f"compression must be one of {MODES}, got {mode!r}")
    if nbytes < 0:
        raise ConfigError("nbytes must be >= 0")
    is_float = dtype_name(dtype) in FLOAT_DTYPES
    if mode == "none" or nbytes < min_bytes:
        return RAW
    chosen = selected_codec(dtype_name(dtype), nbytes, mode, base)
    if chosen is not None:
        return chosen
    if mode == "lossy" and is_float and base == "reference":
        return QDELTA
    if mode == "auto" and not compress_pays:
        return CHUNKS if base == "hashes" else RAW
    if is_float and base in ("bytes", "reference"):
        return XOR
    if base == "hashes":
        return CHUNKS
    return LOSSLESS
