"""Quantized delta (``coci.qdelta/1``): lossy, opt-in, with a recorded error bound.

The delta between the piece and its *reconstruction* in the previous checkpoint (what a restore
of that checkpoint produces, kept in a :class:`QuantState` by the caller) is cut into blocks of
``block`` values. In each block the ``promote`` largest |delta| are kept exactly (priority
promotion, as in LC-Checkpoint), the rest are quantized symmetrically to ``bits`` (8, 4 or 2)
with one float32 scale per block (float64 for float64 pieces), then the whole is
zstd-compressed (zstd's entropy stage stands in for LC-Checkpoint's Huffman code).

Error feedback: because the delta is taken against the previous *reconstruction*, the
quantization residual of one save is part of the next save's delta, so errors do not add up
over a chain; each save's error is that save's quantization error alone.

Non-finite values (in the piece or its base) are stored exactly. ``max_abs_error`` in the
parameters is the measured maximum |original - decoded| (computed from the same reconstruction
the decoder performs, so a decode never exceeds it); ``rel_error`` is
||original - decoded||_2 / ||original||_2. Bits may be chosen per tensor (``bits="auto"``): the
fewest bits whose ``rel_error`` stays under ``target`` (Inshrinkerator's idea of per-tensor
precision from measured sensitivity, with the reconstruction error as the measure).

Log domain (``coci.qdelta-log/1``), for tensors that are never negative and matter by their
*relative* precision (Adam's ``exp_avg_sq``: a step divides by ``sqrt(v)``): the delta is
``log2(x) - log2(ref)`` (same blocks, promotion, bits, error feedback), and each block stores a
factor ``f = 2**step`` instead of a scale; a value is rebuilt as ``ref * f**q`` (``f**q`` by
repeated squaring in float64: multiplications and one division only, so every platform
rebuilds the same bits). A positive value therefore stays positive with a relative error of at
most about ``sqrt(f) - 1``; values that are not positive normal numbers in both the piece and
its reference (zeros, negatives, subnormals, non-finite) are kept as they are when unchanged and
stored exactly otherwise, so exact zeros stay exactly zero. A reconstruction that would leave
the positive normal range (underflow, overflow) is stored exactly too. Parameters record
``max_rel_error`` (the measured max |original - decoded| / |original|) besides
``max_abs_error`` and ``rel_error``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

from coci_core.codecs._common import (
    FLOAT_DTYPES,
    U8,
    Buffer,
    Encoded,
    Params,
    QuantState,
    pack_sections,
    u8,
    unpack_sections,
    writable_u8,
    xxh128,
)
from coci_core.codecs._params import (
    base_fields,
    check_base,
    check_out,
    check_result,
    p_bool,
    p_dict,
    p_float,
    p_int,
    p_str,
)
from coci_core.codecs.lossless import LOSSLESS, decode_lossless, encode_lossless
from coci_core.codecs.quantizer import (
    BITS,
    LOG_MAX_STEP,
    OUTLIER_MAX_RATIO,
    Domain,
    Parts,
    Spec,
    float_dtype,
    pack_bits,
    quantize_blocks,
    reconstruct,
    reconstruct_log,
    scale_dtype,
    unpack_bits,
)
from coci_core.codecs.registry import Codec, EncodeArgs, register_codec
from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = [
    "QDELTA",
    "QDELTA2",
    "QDELTAS",
    "QDELTA_LOG",
    "QuantState",
    "choose_bits",
    "decode_quantized",
    "encode_quantized",
]

QDELTA = "coci.qdelta/1"
QDELTA2 = "coci.qdelta/2"
QDELTA_LOG = "coci.qdelta-log/1"
QDELTAS = (QDELTA, QDELTA2, QDELTA_LOG)


def _check_args(bits: int, block: int, promote: int) -> None:
    if bits not in BITS:
        raise ConfigError(f"bits must be one of {BITS}, got {bits}")
    if not 1 <= block <= 65536:
        raise ConfigError(f"block must be in [1, 65536], got {block}")
    if not 0 <= promote < block:
        raise ConfigError(f"promote must be in [0, block), got {promote}")


def _inputs(data: Buffer, dtype: str | torch.dtype, state: QuantState) -> tuple[U8, str, int]:
    name, itemsize = float_dtype(dtype)
    x = u8(data)
    if x.nbytes % itemsize:
        raise ConfigError(f"a {name} piece must be a whole number of elements")
    if state.ref is None:
        raise ConfigError("QuantState has no reference: save the piece losslessly, then reset()")
    if state.ref.nbytes != x.nbytes:
        raise ConfigError(f"piece has {x.nbytes} bytes, its reference {state.ref.nbytes}")
    return x, name, itemsize


def choose_bits(
    data: Buffer,
    dtype: str | torch.dtype,
    state: QuantState,
    *,
    target: float = 1e-3,
    candidates: tuple[int, ...] = BITS,
    block: int = 256,
    promote: int = 4,
    nonnegative: bool = False,
    domain: Domain = "linear",
    max_log_step: float | None = None,
    exact_outliers: bool = False,
) -> int:
    """The fewest bits in ``candidates`` whose relative L2 reconstruction error is <= ``target``.

    Quantizes the delta once per candidate (cheap next to a save's I/O); the largest candidate
    when none meets the target.
    """
    x, name, itemsize = _inputs(data, dtype, state)
    compact = not exact_outliers
    for bits in sorted(candidates):
        spec = Spec(
            name, itemsize, bits, block, promote, nonnegative, domain, max_log_step, compact
        )
        _, _, _, rel, _ = _quantize_delta(x, state, spec)
        if rel <= target:
            return bits
    return max(candidates)


def _quantize_delta(x: U8, state: QuantState, spec: Spec) -> tuple[Parts, U8, float, float, float]:
    """Check the arguments and quantize ``x``'s delta against the state's reference (the
    previous reconstruction: error feedback)."""
    _check_args(spec.bits, spec.block, spec.promote)
    assert state.ref is not None
    return quantize_blocks(x, state.ref, spec)


def encode_quantized(
    data: Buffer,
    dtype: str | torch.dtype,
    state: QuantState,
    *,
    bits: int | Literal["auto"] = 8,
    block: int = 256,
    promote: int = 4,
    target: float = 1e-3,
    nonnegative: bool = False,
    domain: Domain = "linear",
    max_log_step: float | None = None,
    exact_outliers: bool = False,
    level: int = 3,
    step: int | None = None,
) -> Encoded:
    """Lossy delta of ``data`` against ``state.ref``; then call ``state.commit()`` once durable.

    ``promote`` values per block (outliers) are kept apart: as float16 multiples of the
    block's scale (``coci.qdelta/2``; those beyond 1024 scales exactly), or exactly
    (``exact_outliers``: the ``coci.qdelta/1`` layout; always in the log domain).
    ``nonnegative`` clamps the reconstruction at zero (for values that are never negative, e.g.
    Adam's ``exp_avg_sq``, where a small negative error would make a NaN). ``domain="log"``
    (``coci.qdelta-log/1``) quantizes the delta of ``log2`` of the values instead: a bounded
    *relative* error (each block's step capped at ``max_log_step``, default by bits:
    ``MAX_LOG_STEP``), positive values stay positive (see the module docstring;
    ``nonnegative`` is then moot). Parameters record ``bits``,
    ``max_abs_error``, ``rel_error`` (and ``max_rel_error`` in the log domain), ``generation``
    (lossy saves since the lossless base, this one included) and the base (``base_step`` is
    ``state.ref_step``; ``step``, this save's step, becomes it on commit).
    """
    if domain not in ("linear", "log"):
        raise ConfigError(f"domain must be 'linear' or 'log', got {domain!r}")
    x, name, itemsize = _inputs(data, dtype, state)
    assert state.ref is not None
    if bits == "auto":
        bits = choose_bits(
            x,
            name,
            state,
            target=target,
            block=block,
            promote=promote,
            nonnegative=nonnegative,
            domain=domain,
            max_log_step=max_log_step,
            exact_outliers=exact_outliers,
        )
    if max_log_step is not None and not 0 < max_log_step <= LOG_MAX_STEP:
        raise ConfigError(f"max_log_step must be in (0, {LOG_MAX_STEP}], got {max_log_step}")
    compact = domain == "linear" and not exact_outliers
    spec = Spec(name, itemsize, bits, block, promote, nonnegative, domain, max_log_step, compact)
    parts, rec, max_err, rel, max_rel = _quantize_delta(x, state, spec)
    blob = pack_sections(
        [
            parts.scales.astype(scale_dtype(name)),
            parts.promo_pos.astype("<u2"),
            parts.promo_val,
            parts.exc_idx.astype("<u8"),
            parts.exc_val,
            pack_bits(parts.q, bits),
        ]
    )
    inner = encode_lossless(np.frombuffer(blob, np.uint8), "uint8", level=level)
    params: Params = {
        "codec": QDELTA_LOG if domain == "log" else (QDELTA2 if compact else QDELTA),
        "nbytes": x.nbytes,
        "itemsize": itemsize,
        "dtype": name,
        "bits": bits,
        "block": block,
        "promote": promote,
    }
    if domain == "linear":
        params["nonnegative"] = nonnegative
    params.update(
        {
            "exceptions": int(parts.exc_idx.size),
            **base_fields(state.ref_step),
            "base_xxh3": xxh128(state.ref),
            "exact": False,
            "max_abs_error": max_err,
            "rel_error": rel,
        }
    )
    if domain == "log":
        params["max_rel_error"] = max_rel
    params.update({"generation": state.generation + 1, "xxh3": xxh128(rec), "inner": inner.params})
    state._pending = (rec, step)
    return Encoded(inner.data, params)


def _p_bound(params: Params, key: str) -> float:
    """A recorded error: a finite number >= 0 (a manifest is data from disk)."""
    v = p_float(params, key)
    if not (np.isfinite(v) and v >= 0):
        raise CorruptCheckpointError(f"codec parameter {key!r}={v!r} is not a finite bound >= 0")
    return v


def decode_quantized(stored: Buffer, params: Params, out: Buffer, base: Buffer | None) -> None:
    """Write the reconstruction into ``out``; ``base`` is the previous checkpoint's decoded piece.

    The result differs from the original by at most ``params["max_abs_error"]`` per value (and,
    for ``coci.qdelta-log/1``, by at most ``params["max_rel_error"]`` of each value's size).
    """
    codec = p_str(params, "codec")
    if codec not in QDELTAS:
        raise CorruptCheckpointError(f"parameters are for codec {codec!r}, not a quantized delta")
    log, compact = codec == QDELTA_LOG, codec == QDELTA2
    dst = writable_u8(out)
    n_bytes = check_out(params, dst)
    name = p_str(params, "dtype")
    if name not in FLOAT_DTYPES or p_int(params, "itemsize") != FLOAT_DTYPES[name]:
        raise CorruptCheckpointError(f"bad dtype/itemsize for a quantized delta: {name!r}")
    itemsize = FLOAT_DTYPES[name]
    bits, block, promote = (p_int(params, k) for k in ("bits", "block", "promote"))
    nexc = p_int(params, "exceptions")
    try:
        _check_args(bits, block, promote)
    except ConfigError as e:
        raise CorruptCheckpointError(str(e)) from None
    if n_bytes % itemsize or nexc > n_bytes // itemsize:
        raise CorruptCheckpointError("quantized delta has inconsistent sizes")
    if p_bool(params, "exact") or p_int(params, "generation") < 1:
        raise CorruptCheckpointError("a quantized delta is inexact and of generation >= 1")
    for key in ("max_abs_error", "rel_error", *(("max_rel_error",) if log else ())):
        _p_bound(params, key)
    nonneg = False if log else p_bool(params, "nonnegative")
    ref = check_base(params, base, n_bytes)
    n = n_bytes // itemsize
    nb = -(-n // block)
    sizes = [
        nb * np.dtype(scale_dtype(name)).itemsize,
        nb * promote * 2,
        nb * promote * (2 if compact else itemsize),
        nexc * 8,
        nexc * itemsize,
        -(-nb * block // (8 // bits)),
    ]
    inner = p_dict(params, "inner")
    inner_bytes = p_int(inner, "nbytes")
    if p_str(inner, "codec") != LOSSLESS or inner_bytes != 8 + 8 * 6 + sum(sizes):
        raise CorruptCheckpointError("quantized delta's inner stream has the wrong size")
    blob = np.empty(8 + 8 * 6 + sum(sizes), np.uint8)
    decode_lossless(stored, inner, blob)
    secs = unpack_sections(blob, 6)
    if [s.nbytes for s in secs] != sizes:
        raise CorruptCheckpointError("quantized delta's sections have the wrong sizes")
    pos = np.frombuffer(secs[1], "<u2").reshape(nb, promote)
    exc_idx = np.frombuffer(secs[3], "<u8")
    if (pos.size and int(pos.max()) >= block) or (exc_idx.size and int(exc_idx.max()) >= n):
        raise CorruptCheckpointError("quantized delta has out-of-range indices")
    scales = np.frombuffer(secs[0], scale_dtype(name)).astype(scale_dtype(name))
    if not np.all(np.isfinite(scales)):
        raise CorruptCheckpointError("quantized delta has non-finite scales")
    if log and scales.size and not (scales.min() >= 1 and scales.max() <= 2.0**LOG_MAX_STEP):
        raise CorruptCheckpointError("log-domain quantized delta has factors outside [1, 2**64]")
    if compact and not np.all(np.abs(np.frombuffer(secs[2], "<f2")) <= OUTLIER_MAX_RATIO):
        raise CorruptCheckpointError("quantized delta has outliers beyond their range")
    parts = Parts(
        scales,
        pos.astype(np.uint16),
        np.frombuffer(secs[2], np.uint8),
        exc_idx.astype(np.uint64),
        np.frombuffer(secs[4], np.uint8),
        unpack_bits(np.frombuffer(secs[5], np.uint8), bits, nb * block),
    )
    if log:
        dst[:] = reconstruct_log(ref, parts, name, itemsize, block, bits)
    else:
        dst[:] = reconstruct(ref, parts, name, itemsize, block, nonneg, compact)
    check_result(params, dst)


def _encode_quantized_piece(data: memoryview, args: EncodeArgs) -> Encoded:
    """The writer's lossy delta (its inner zstd keeps its own level)."""
    if args.reference is None:
        raise ConfigError(f"{QDELTA} needs the lossy chain's reference of the piece")
    lossy = dataclasses.asdict(args.lossy)  # bits, promote, target, nonnegative, domain
    return encode_quantized(data, args.dtype, args.reference, step=args.step, **lossy)


def _decode_quantized(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    decode_quantized(stored, params, out, base)


# choose_codec names the lossy delta QDELTA; its encoder writes QDELTA2 or QDELTA_LOG
# (QDELTA's own layout only with exact_outliers); each name decodes.
register_codec(
    Codec(QDELTA, _decode_quantized, _encode_quantized_piece, needs="reference", deltas=True)
)
register_codec(Codec(QDELTA2, _decode_quantized, needs="reference", deltas=True))
register_codec(Codec(QDELTA_LOG, _decode_quantized, needs="reference", deltas=True))
