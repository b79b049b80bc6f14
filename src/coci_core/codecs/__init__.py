"""Codecs turn a leaf's raw bytes into stored bytes and back; each names itself in the manifest.

Restore picks the decoder by the codec name stored with each piece (``"coci.raw/1"``: the bytes
as they are in memory), so a reader never needs to be told how a checkpoint was written.

Array codecs (one tensor piece's bytes, optionally against the same piece in a base checkpoint)
are functions: an encoder returns :class:`Encoded` (stored bytes + JSON-able ``params``, whose
``"codec"`` names it) and :func:`decode`, the one dispatch on that name, writes the piece back
given those params:

- :func:`encode_lossless` ``coci.zstd/1``: byte-shuffle + zstd;
- :func:`encode_xor` ``coci.xor-zstd/1``: XOR against the base's bytes, then as above;
- :func:`encode_chunked` ``coci.chunks/1``: only chunks whose XXH3-128 differs from the base's;
- :func:`encode_quantized` ``coci.qdelta/1``: lossy quantized delta with a recorded error bound;
  ``coci.qdelta-log/1`` (``domain="log"``): the same on ``log2`` of positive values, with a
  recorded relative bound;
- :func:`choose_codec`, :func:`compression_pays`: which codec, and whether compressing pays.
"""

from __future__ import annotations

from collections.abc import Callable

from coci_core.codecs._common import Buffer, Encoded, Params, u8, writable_u8
from coci_core.codecs._params import p_bool, p_str
from coci_core.codecs.chunked import (
    CHUNKS,
    chunk_hashes,
    decode_chunked,
    encode_chunked,
    stored_hashes,
)
from coci_core.codecs.lossless import (
    LOSSLESS,
    XOR,
    decode_lossless,
    decode_xor,
    encode_lossless,
    encode_xor,
)
from coci_core.codecs.quantized import (
    QDELTAS,
    QuantState,
    choose_bits,
    decode_quantized,
    encode_quantized,
)
from coci_core.codecs.select import choose_codec, compression_pays, time_to_durable
from coci_core.errors import CorruptCheckpointError

__all__ = [
    "RAW",
    "Encoded",
    "Params",
    "QuantState",
    "choose_bits",
    "choose_codec",
    "chunk_hashes",
    "compression_pays",
    "decode",
    "encode_chunked",
    "encode_lossless",
    "encode_quantized",
    "encode_xor",
    "needs_base",
    "stored_hashes",
    "time_to_durable",
]

RAW = "coci.raw/1"

# (stored, params, out, base, threads): writes the piece into out
Decoder = Callable[[Buffer, Params, Buffer, Buffer | None, int], None]


def _decode_raw(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    """Bytes as they are in memory: no transformation."""
    src, dst = u8(stored), writable_u8(out)
    if src.nbytes != dst.nbytes:
        raise CorruptCheckpointError(f"raw data has {src.nbytes} bytes, expected {dst.nbytes}")
    dst[:] = src


# the one codec dispatch: every array codec a reader knows, by the name stored with each piece
_DECODERS: dict[str, Decoder] = {
    RAW: _decode_raw,
    LOSSLESS: lambda s, p, o, b, t: decode_lossless(s, p, o, threads=t),
    XOR: lambda s, p, o, b, t: decode_xor(s, p, o, b, threads=t),
    CHUNKS: lambda s, p, o, b, t: decode_chunked(s, p, o, b, threads=t),
    **dict.fromkeys(QDELTAS, lambda s, p, o, b, t: decode_quantized(s, p, o, b)),
}


def needs_base(params: Params) -> bool:
    """Whether decoding this piece needs the base checkpoint's decoded bytes of the same piece."""
    return p_str(params, "codec") != RAW and p_bool(params, "base")


def decode(
    stored: Buffer,
    params: Params,
    out: Buffer,
    base: Buffer | None = None,
    *,
    threads: int = 1,
) -> None:
    """Write the piece described by ``params`` into the preallocated ``out``.

    ``base``: the same piece decoded from the base checkpoint, when :func:`needs_base` says so.
    Raises CorruptCheckpointError on any malformed input; never executes code from data.
    """
    codec = p_str(params, "codec")
    decoder = _DECODERS.get(codec)
    if decoder is None:
        raise CorruptCheckpointError(f"unknown array codec {codec!r}")
    if codec != RAW and not needs_base(params):
        base = None  # validates the "base" field, and a stray base is never consulted
    decoder(stored, params, out, base, threads)
