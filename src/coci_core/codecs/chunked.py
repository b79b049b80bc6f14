"""Chunk-incremental codec (``coci.chunks/1``): only the chunks that changed since the base.

The piece is cut into fixed chunks (64 KiB by default; the last may be shorter), each hashed with
XXH3-128; the hashes' Merkle root is recorded in the parameters. The encoder is given the base's
chunk hashes (kept from the previous encode, see ``Encoded.hashes``, or recomputed with
:func:`chunk_hashes` from restored bytes), never the base's bytes, and stores the new hash list,
the indices of changed chunks and those chunks (optionally shuffle + zstd). A frozen tensor costs
16 bytes per chunk.

Why XXH3-128 rather than crc32c: a chunk whose hash collides with its base's is silently *not
written*; with 32 bits that is a 2^-32 chance per changed chunk, which a long run with large
models can reach (1e9 changed chunks ~ 0.2 expected stale chunks). With 128 bits it cannot
happen in practice, and XXH3 runs at ~20 GB/s here (faster than crc32c), so it costs nothing.
The decoder re-hashes every chunk it writes (the ones from the base and the new ones) and
raises CorruptCheckpointError when one does not match the recorded hash.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from coci_core.codecs._common import (
    Buffer,
    Encoded,
    Params,
    itemsize_of,
    pack_sections,
    u8,
    unpack_sections,
    writable_u8,
    xxh128,
)
from coci_core.codecs._params import (
    base_fields,
    check_codec,
    check_out,
    check_result,
    p_bool,
    p_dict,
    p_int,
    p_str,
)
from coci_core.codecs.lossless import LOSSLESS, decode_lossless, encode_lossless
from coci_core.codecs.registry import (
    RAW,
    Codec,
    EncodeArgs,
    register_codec,
    stores_compressed,
)
from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = [
    "CHUNKS",
    "DEFAULT_CHUNK",
    "HASH_SIZE",
    "chunk_hashes",
    "decode_chunked",
    "encode_chunked",
    "merkle_root",
    "stored_hashes",
]

CHUNKS = "coci.chunks/1"
DEFAULT_CHUNK = 64 << 10
HASH_SIZE = 16


def chunk_hashes(data: Buffer, chunk: int = DEFAULT_CHUNK) -> bytes:
    """The XXH3-128 digests of ``data``'s chunks, packed (16 bytes each)."""
    if chunk <= 0 or chunk % 64:
        raise ConfigError(f"chunk must be a positive multiple of 64, got {chunk}")
    arr = u8(data)
    return b"".join(
        xxhash.xxh3_128_digest(arr[i : i + chunk].data) for i in range(0, arr.nbytes, chunk)
    )


def merkle_root(hashes: bytes) -> str:
    """Hex Merkle root of packed chunk hashes (pairs hashed upward, an odd node carried up)."""
    if len(hashes) % HASH_SIZE:
        raise ConfigError("packed hashes must be a multiple of 16 bytes")
    level = [hashes[i : i + HASH_SIZE] for i in range(0, len(hashes), HASH_SIZE)]
    if not level:
        return xxhash.xxh3_128_hexdigest(b"coci-empty")
    while len(level) > 1:
        nxt = [
            xxhash.xxh3_128_digest(b"\x01" + level[i] + level[i + 1])
            for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].hex()


def encode_chunked(
    data: Buffer,
    dtype: str | torch.dtype,
    *,
    base_hashes: bytes | None,
    base_step: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    compress: bool = True,
    level: int = 1,
    threads: int = 1,
) -> Encoded:
    """Store the chunks of ``data`` whose hash is not the base's (all of them without a base).

    ``base_hashes`` must be the hashes of the same piece (same size, same ``chunk``) in the
    base checkpoint; when it does not fit, every chunk is stored and no base is needed. The
    result's ``hashes`` are this piece's hashes, for the next save.
    """
    arr = u8(data)
    itemsize = itemsize_of(dtype)
    hashes = chunk_hashes(arr, chunk)
    nchunks = len(hashes) // HASH_SIZE
    use_base = base_hashes is not None and len(base_hashes) == len(hashes)
    if use_base:
        assert base_hashes is not None
        old = np.frombuffer(base_hashes, np.uint8).reshape(nchunks, HASH_SIZE)
        new = np.frombuffer(hashes, np.uint8).reshape(nchunks, HASH_SIZE)
        changed = np.flatnonzero((old != new).any(axis=1)).astype("<u4")
    else:
        changed = np.arange(nchunks, dtype="<u4")
    if changed.size == nchunks:
        payload = arr
    elif changed.size == 0:
        payload = arr[:0]
    else:
        payload = np.concatenate([arr[int(i) * chunk : (int(i) + 1) * chunk] for i in changed])
    inner: Params
    if compress:
        enc = encode_lossless(payload, dtype, level=level, threads=threads)
        body: Buffer = enc.data
        inner = enc.params
    else:
        body = payload
        inner = {"codec": RAW, "nbytes": int(payload.nbytes)}
    params: Params = {
        "codec": CHUNKS,
        "nbytes": arr.nbytes,
        "itemsize": itemsize,
        "chunk": chunk,
        "nchunks": nchunks,
        "changed": int(changed.size),
        "root": merkle_root(hashes),
        **(base_fields(base_step) if use_base else {"base": False}),
        "inner": inner,
        "exact": True,
        "xxh3": xxh128(arr),
    }
    if use_base:
        assert base_hashes is not None
        params["base_root"] = merkle_root(base_hashes)
    return Encoded(pack_sections([hashes, changed.tobytes(), body]), params, hashes=hashes)


def _sections(stored: Buffer, params: Params) -> tuple[bytes, memoryview, memoryview]:
    nchunks = p_int(params, "nchunks")
    hashes, idx, body = unpack_sections(stored, 3)
    if hashes.nbytes != nchunks * HASH_SIZE:
        raise CorruptCheckpointError("stored chunk hash list has the wrong size")
    hb = bytes(hashes)
    if merkle_root(hb) != p_str(params, "root"):
        raise CorruptCheckpointError("stored chunk hashes do not match the recorded Merkle root")
    return hb, idx, body


def stored_hashes(stored: Buffer, params: Params) -> bytes:
    """The packed chunk hashes inside a stored ``coci.chunks/1`` piece (checked against root)."""
    check_codec(params, CHUNKS)
    return _sections(stored, params)[0]


def decode_chunked(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, *, threads: int = 1
) -> None:
    """Write the piece into ``out``: changed chunks from ``stored``, the rest from ``base``.

    ``base`` is the base checkpoint's decoded bytes of the same piece (needed when
    ``params["base"]`` is true). Every chunk written is checked against its recorded hash.
    """
    check_codec(params, CHUNKS)
    dst = writable_u8(out)
    n = check_out(params, dst)
    chunk = p_int(params, "chunk", lo=64)
    p_int(params, "itemsize", lo=1, hi=64)
    nchunks = p_int(params, "nchunks")
    if nchunks != -(-n // chunk):
        raise CorruptCheckpointError("chunk count does not match size and chunk length")
    hashes, idx_mv, body = _sections(stored, params)
    if idx_mv.nbytes % 4:
        raise CorruptCheckpointError("changed-chunk index list has a bad size")
    idx = np.frombuffer(idx_mv, "<u4").astype(np.int64)
    if idx.size != p_int(params, "changed") or (
        idx.size and (idx[0] < 0 or idx[-1] >= nchunks or np.any(np.diff(idx) <= 0))
    ):
        raise CorruptCheckpointError("changed-chunk index list is malformed")
    uses_base = p_bool(params, "base")
    if not uses_base and idx.size != nchunks:
        raise CorruptCheckpointError("a piece without a base must store every chunk")
    if uses_base:
        if base is None:
            raise CorruptCheckpointError("this piece is incremental: its base's bytes are needed")
        b = u8(base)
        if b.nbytes != n:
            raise CorruptCheckpointError(f"base has {b.nbytes} bytes, the piece expects {n}")
    plen = sum(min(chunk, n - int(i) * chunk) for i in idx)
    payload = np.empty(plen, np.uint8)
    inner = p_dict(params, "inner")
    codec = p_str(inner, "codec")
    if codec == LOSSLESS:
        decode_lossless(body, inner, payload, threads=threads)
    elif codec == RAW:
        if body.nbytes != plen or p_int(inner, "nbytes") != plen:
            raise CorruptCheckpointError("stored chunks have the wrong size")
        payload[:] = np.frombuffer(body, np.uint8)
    else:
        raise CorruptCheckpointError(f"unknown inner codec {codec!r}")
    is_new = np.zeros(nchunks, bool)
    is_new[idx] = True
    pos = 0
    for i in range(nchunks):
        lo, hi = i * chunk, min((i + 1) * chunk, n)
        if is_new[i]:
            dst[lo:hi] = payload[pos : pos + hi - lo]
            pos += hi - lo
        else:
            dst[lo:hi] = b[lo:hi]
        if xxhash.xxh3_128_digest(dst[lo:hi].data) != hashes[i * HASH_SIZE : (i + 1) * HASH_SIZE]:
            where = "stored" if is_new[i] else "base"
            raise CorruptCheckpointError(f"chunk {i} ({where}) does not match its recorded hash")
    check_result(params, dst)


def _encode_piece(data: memoryview, args: EncodeArgs) -> Encoded:
    return encode_chunked(
        data,
        args.dtype,
        base_hashes=args.base_hashes,
        base_step=args.base_step,
        compress=args.compress,
        level=args.level,
    )


def _compressed(params: Params) -> bool:
    """Whether the changed chunks went through a compressor."""
    inner = params.get("inner")
    return stores_compressed(inner) if isinstance(inner, dict) else True


def _decode_piece(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    decode_chunked(stored, params, out, base, threads=threads)


register_codec(
    Codec(CHUNKS, _decode_piece, _encode_piece, needs="hashes", deltas=True, compressed=_compressed)
)
