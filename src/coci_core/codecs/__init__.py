"""Codecs turn a leaf's raw bytes into stored bytes and back; each names itself in the manifest.

Restore picks the decoder by the codec name stored with each piece (``"coci.raw/1"``: the bytes
as they are in memory), so a reader never needs to be told how a checkpoint was written.

Every codec is a :class:`Codec` in one registry (``registry.py``: how to add one), holding its
name's decoder and encoder. Array codecs (one tensor piece's bytes, optionally against the same
piece in a base checkpoint) are functions: an encoder returns :class:`Encoded` (stored bytes +
JSON-able ``params``, whose ``"codec"`` names it) and :func:`decode`, the one dispatch on that
name, writes the piece back given those params:

- :func:`encode_lossless` ``coci.zstd/1``: byte-shuffle + zstd;
- :func:`encode_xor` ``coci.xor-zstd/1``: XOR against the base's bytes, then as above;
- :func:`encode_chunked` ``coci.chunks/1``: only chunks whose XXH3-128 differs from the base's;
- :func:`encode_quantized` ``coci.qdelta/1``: lossy quantized delta with a recorded error bound;
  ``coci.qdelta-log/1`` (``domain="log"``): the same on ``log2`` of positive values, with a
  recorded relative bound;
- :func:`choose_codec`, :func:`compression_pays`: which codec, and whether compressing pays;
- :func:`register_codec`: a codec of one's own, written and read as the built-in ones.
"""

from __future__ import annotations

from coci_core.codecs._common import Encoded, Params
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
from coci_core.codecs.registry import (
    RAW,
    Codec,
    Decoder,
    EncodeArgs,
    Encoder,
    LossyArgs,
    decode,
    get_codec,
    needs_base,
    register_codec,
    stores_compressed,
    unregister_codec,
)
from coci_core.codecs.select import (
    choose_codec,
    compression_pays,
    time_to_durable,
    time_to_restore,
)

__all__ = [
    "CHUNKS",
    "LOSSLESS",
    "QDELTAS",
    "RAW",
    "XOR",
    "Codec",
    "Decoder",
    "EncodeArgs",
    "Encoded",
    "Encoder",
    "LossyArgs",
    "Params",
    "QuantState",
    "choose_bits",
    "choose_codec",
    "chunk_hashes",
    "compression_pays",
    "decode",
    "decode_chunked",
    "decode_lossless",
    "decode_quantized",
    "decode_xor",
    "encode_chunked",
    "encode_lossless",
    "encode_quantized",
    "encode_xor",
    "get_codec",
    "needs_base",
    "register_codec",
    "stored_hashes",
    "stores_compressed",
    "time_to_durable",
    "time_to_restore",
    "unregister_codec",
]
