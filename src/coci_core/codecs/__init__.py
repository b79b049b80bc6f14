"""Codecs turn a leaf's raw bytes into stored bytes and back; each names itself in the manifest.

Restore rebuilds the codec from the descriptor stored with each tensor (``"coci.raw/1"``), so a
reader never needs to be told how a checkpoint was written.

Array codecs (one tensor piece's bytes, optionally against the same piece in a base checkpoint)
are functions: an encoder returns :class:`Encoded` (stored bytes + JSON-able ``params``, whose
``"codec"`` names it) and :func:`decode` writes the piece back given those params:

- :func:`encode_lossless` ``coci.zstd/1``: byte-shuffle + zstd;
- :func:`encode_xor` ``coci.xor-zstd/1``: XOR against the base's bytes, then as above;
- :func:`encode_chunked` ``coci.chunks/1``: only chunks whose XXH3-128 differs from the base's;
- :func:`encode_quantized` ``coci.qdelta/1``: lossy quantized delta with a recorded error bound;
  ``coci.qdelta-log/1`` (``domain="log"``): the same on ``log2`` of positive values, with a
  recorded relative bound;
- :func:`choose_codec`, :func:`compression_pays`: which codec, and whether compressing pays.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = [
    "Codec",
    "Encoded",
    "Params",
    "QuantState",
    "RawCodec",
    "choose_bits",
    "choose_codec",
    "chunk_hashes",
    "compression_pays",
    "decode",
    "encode_chunked",
    "encode_lossless",
    "encode_quantized",
    "encode_xor",
    "from_descriptor",
    "needs_base",
    "register",
    "stored_hashes",
    "time_to_durable",
]


@runtime_checkable
class Codec(Protocol):
    """Called as: (writer thread) ``encode``; (reader) ``decode``; both on any rank."""

    def descriptor(self) -> str:
        """The versioned name stored in the manifest, e.g. ``"coci.raw/1"``."""
        ...

    def encode(self, data: memoryview) -> memoryview:
        """The stored bytes of ``data`` (may be ``data`` itself)."""
        ...

    def decode(self, stored: memoryview, out: memoryview) -> None:
        """Write the original bytes of ``stored`` into ``out``."""
        ...


class RawCodec:
    """Bytes as they are in memory: no transformation."""

    def descriptor(self) -> str:
        return "coci.raw/1"

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, stored: memoryview, out: memoryview) -> None:
        if stored.nbytes != out.nbytes:
            raise CorruptCheckpointError(
                f"raw data has {stored.nbytes} bytes, expected {out.nbytes}"
            )
        out.cast("B")[:] = stored.cast("B")


_REGISTRY: dict[str, type[Codec]] = {"coci.raw/1": RawCodec}


def register(descriptor: str, codec: type[Codec], *, clobber: bool = False) -> None:
    """Make ``codec`` available to restore under ``descriptor``."""
    if descriptor in _REGISTRY and not clobber:
        raise ConfigError(f"codec {descriptor!r} is already registered; pass clobber=True")
    _REGISTRY[descriptor] = codec


def from_descriptor(descriptor: str) -> Codec:
    """The codec that wrote ``descriptor``."""
    try:
        return _REGISTRY[descriptor]()
    except KeyError:
        raise CorruptCheckpointError(
            f"unknown codec {descriptor!r}; known: {sorted(_REGISTRY)}"
        ) from None


# Array codecs (imported here, after the registry, so that they may import this package).
from coci_core.codecs._common import Buffer, Encoded, Params, p_bool, p_str, u8, writable_u8  # noqa: E402
from coci_core.codecs.chunked import (  # noqa: E402
    CHUNKS,
    chunk_hashes,
    decode_chunked,
    encode_chunked,
    stored_hashes,
)
from coci_core.codecs.lossless import (  # noqa: E402
    LOSSLESS,
    XOR,
    decode_lossless,
    decode_xor,
    encode_lossless,
    encode_xor,
)
from coci_core.codecs.quantized import (  # noqa: E402
    QDELTAS,
    QuantState,
    choose_bits,
    decode_quantized,
    encode_quantized,
)
from coci_core.codecs.select import choose_codec, compression_pays, time_to_durable  # noqa: E402


def needs_base(params: Params) -> bool:
    """Whether decoding this piece needs the base checkpoint's decoded bytes of the same piece."""
    return p_str(params, "codec") != "coci.raw/1" and p_bool(params, "base")


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
    if codec != "coci.raw/1" and not needs_base(params):
        base = None  # validates the "base" field, and a stray base is never consulted
    if codec == "coci.raw/1":
        RawCodec().decode(u8(stored).data, writable_u8(out).data)
    elif codec == LOSSLESS:
        decode_lossless(stored, params, out, threads=threads)
    elif codec == XOR:
        decode_xor(stored, params, out, base, threads=threads)
    elif codec == CHUNKS:
        decode_chunked(stored, params, out, base, threads=threads)
    elif codec in QDELTAS:
        decode_quantized(stored, params, out, base)
    else:
        raise CorruptCheckpointError(f"unknown array codec {codec!r}")
