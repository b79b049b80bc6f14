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

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from coci_core.codecs._common import (
    FLOAT_DTYPES,
    U8,
    Buffer,
    Encoded,
    Params,
    base_fields,
    check_base,
    check_out,
    check_result,
    dtype_name,
    p_bool,
    p_dict,
    p_float,
    p_int,
    p_str,
    pack_sections,
    u8,
    unpack_sections,
    writable_u8,
    xxh128,
)
from coci_core.codecs.lossless import LOSSLESS, decode_lossless, encode_lossless
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
Domain = Literal["linear", "log"]
BITS = (2, 4, 8)
# log domain: a value that changed by more than 2**LOG_MAX_STEP (or 2**-LOG_MAX_STEP) since
# the reference is stored exactly, so a block's factor stays well inside float32's range
LOG_MAX_STEP = 64.0
# log domain: the default cap of a block's step per bits, in log2 units (the relative error stays
# under about 2**(cap/2) - 1: 19%, 3.5%, 0.35%)
MAX_LOG_STEP = {2: 0.5, 4: 0.1, 8: 0.01}
# coci.qdelta/2: an outlier is stored as float16 multiples of its block's scale, up to this many
# (float16's spacing there is 1/2 scale: the outlier's error stays under half a scale too)
OUTLIER_MAX_RATIO = 1024.0
_UINT = {2: "<u2", 4: "<u4", 8: "<u8"}
Work = npt.NDArray[Any]  # float32 (float16/bfloat16/float32 pieces) or float64


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


# --- float views ------------------------------------------------------------------------


def _to_work(raw: U8, dtype: str) -> Work:
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "float32":
        return raw.view("<f4").astype(np.float32)
    return raw.view("<f8").astype(np.float64)


def _from_work(w: Work, dtype: str) -> U8:
    if dtype == "float16":
        return w.astype(np.float16).view(np.uint8)
    if dtype == "bfloat16":
        u = w.astype(np.float32).view(np.uint32)
        # round to nearest even on the 16 dropped bits; NaNs stay (quiet) NaNs
        r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        r[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype("<u2")
        return r.view(np.uint8)
    return w.astype("<f4" if dtype == "float32" else "<f8").view(np.uint8)


def _float_dtype(dtype: str | torch.dtype) -> tuple[str, int]:
    name = dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"quantized delta needs a float dtype, got {name!r}")
    return name, FLOAT_DTYPES[name]


# --- the shared reconstruction (encoder simulates exactly what the decoder does) ---------


def _scale_dtype(dtype: str) -> str:
    return "<f8" if dtype == "float64" else "<f4"


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _pack(q: npt.NDArray[np.int8], bits: int) -> U8:
    u = (q.astype(np.int16) + _qmax(bits)).astype(np.uint8)
    per = 8 // bits
    u = np.concatenate([u, np.zeros(-u.size % per, np.uint8)]).reshape(-1, per)
    out = np.zeros(u.shape[0], np.uint8)
    for j in range(per):
        out |= u[:, j] << np.uint8(j * bits)
    return out


def _unpack(packed: U8, bits: int, count: int) -> npt.NDArray[np.int8]:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    u = np.empty((packed.size, per), np.uint8)
    for j in range(per):
        u[:, j] = (packed >> np.uint8(j * bits)) & mask
    q = u.reshape(-1)[:count].astype(np.int16) - _qmax(bits)
    if q.size and (q.min() < -_qmax(bits) or q.max() > _qmax(bits)):
        raise CorruptCheckpointError("quantized values out of range")
    return q.astype(np.int8)


@dataclass
class _Parts:
    scales: Work  # (nblocks,) float32, or float64 for float64 pieces (deltas beyond float32)
    promo_pos: npt.NDArray[np.uint16]  # (nblocks, promote) positions within the block
    # (nblocks * promote * itemsize) exact bytes (coci.qdelta/1, log domain), or float16
    # multiples of the block's scale (coci.qdelta/2); padding positions hold zeros
    promo_val: U8
    exc_idx: npt.NDArray[np.uint64]  # indices stored exactly (non-finite values and bases)
    exc_val: U8
    q: npt.NDArray[np.int8]  # (nblocks * block,)


def _overwrite_exact(
    out: U8, parts: _Parts, n: int, itemsize: int, block: int, promoted: bool = True
) -> None:
    """The values stored exactly (promoted per block unless ``promoted`` is False, and the
    exceptions) over a reconstruction."""
    nb = parts.scales.size
    view = out.reshape(n, itemsize) if itemsize else out
    if promoted and parts.promo_pos.size:
        flat = (np.arange(nb, dtype=np.int64)[:, None] * block + parts.promo_pos).reshape(-1)
        keep = flat < n
        vals = parts.promo_val.reshape(-1, itemsize)
        view[flat[keep]] = vals[keep]
    if parts.exc_idx.size:
        view[parts.exc_idx.astype(np.int64)] = parts.exc_val.reshape(-1, itemsize)


def _reconstruct(
    ref: U8,
    parts: _Parts,
    dtype: str,
    itemsize: int,
    block: int,
    nonneg: bool,
    compact: bool = False,
) -> U8:
    """``ref + q * scale``; outliers exact (``compact`` False: coci.qdelta/1) or
    ``ref + ratio * scale`` (``compact``: coci.qdelta/2); then the exceptions."""
    n = ref.nbytes // itemsize
    nb = parts.scales.size
    r = _to_work(ref, dtype)
    wdt = r.dtype
    sc = parts.scales.astype(wdt)[:, None]
    step = parts.q.reshape(nb, block).astype(wdt) * sc
    if compact and parts.promo_pos.size:
        ratio = parts.promo_val.view("<f2").astype(wdt).reshape(nb, -1)
        np.put_along_axis(step, parts.promo_pos.astype(np.int64), ratio * sc, axis=1)
    step = step.reshape(-1)[:n]
    # non-finite entries are overwritten from the exceptions below; overflow is detected by
    # the encoder and turned into exceptions, so these warnings are expected
    with np.errstate(invalid="ignore", over="ignore"):
        w = r + step
        if nonneg:
            w = np.maximum(w, wdt.type(0))
        out = _from_work(w, dtype).copy()
    _overwrite_exact(out, parts, n, itemsize, block, promoted=not compact)
    return out


def _powers(f: npt.NDArray[np.float64], q: npt.NDArray[np.int8], bits: int) -> npt.NDArray[Any]:
    """``f ** q`` per element, by repeated squaring in float64 (``|q| < 2**(bits-1)``).

    Only multiplications and one division, each correctly rounded by IEEE 754, in a fixed
    order: the encoder and every decoder get the same bits (``np.power``/``np.exp2`` may
    differ by an ulp between builds and CPUs, and the result is checked against a hash).
    """
    k = np.abs(q.astype(np.int16))
    out = np.ones(q.shape, np.float64)
    base = f.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(bits - 1):
            out = np.where((k >> j) & 1 == 1, out * base, out)
            base = base * base
        return np.where(q < 0, 1.0 / out, out)


def _reconstruct_log(
    ref: U8, parts: _Parts, dtype: str, itemsize: int, block: int, bits: int
) -> U8:
    """``ref * f**q`` where ``q != 0``, ``ref``'s own bytes elsewhere, then the exact values."""
    n = ref.nbytes // itemsize
    out = ref.copy()
    q = parts.q[:n]
    idx = np.flatnonzero(q)
    if idx.size:
        f = parts.scales.astype(np.float64)[idx // block]
        r = _to_work(ref, dtype)[idx].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            w = r * _powers(f, q[idx], bits)
            out.reshape(n, itemsize)[idx] = _from_work(w, dtype).reshape(-1, itemsize)
    _overwrite_exact(out, parts, n, itemsize, block)
    return out


def _tiny(dtype: str) -> float:
    """The smallest positive normal number of ``dtype``."""
    return {"float16": 2.0**-14, "float64": 2.0**-1022}.get(dtype, 2.0**-126)


@dataclass(frozen=True)
class _Spec:
    """How one delta is quantized: the arguments the quantizers share.

    ``nonneg``: clamp the reconstruction at zero (linear domain); ``max_log_step``: the cap
    on a block's step in the log domain (None: by bits); ``compact``: outliers as float16
    multiples of the block's scale (coci.qdelta/2, linear domain).
    """

    dtype: str
    itemsize: int
    bits: int
    block: int
    promote: int
    nonneg: bool
    domain: Domain
    max_log_step: float | None
    compact: bool

    def grid(self) -> tuple[str, int, int, int, int]:
        """The dtype, item size, bits, block and promoted values per block."""
        return self.dtype, self.itemsize, self.bits, self.block, self.promote


def _quantize(x_raw: U8, r_raw: U8, spec: _Spec) -> tuple[_Parts, U8, float, float, float]:
    """Parts, reconstruction, max abs, relative L2 and max relative error of a linear delta
    (``spec.compact``: outliers as float16 multiples of the block's scale, coci.qdelta/2)."""
    dtype, itemsize, bits, block, promote = spec.grid()
    nonneg, compact = spec.nonneg, spec.compact
    n = x_raw.nbytes // itemsize
    x, r = _to_work(x_raw, dtype), _to_work(r_raw, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        d = x - r
    exc = ~(np.isfinite(x) & np.isfinite(r) & np.isfinite(d))
    d[exc] = 0
    qm = _qmax(bits)
    blocks, pos, mx = _promote_and_scale(d, n, block, promote, qm)
    scales = mx.astype(_scale_dtype(dtype))
    sc = scales.astype(d.dtype)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(sc > 0, np.rint(blocks / np.where(sc > 0, sc, 1)), 0)
    q = np.clip(q, -qm, qm).astype(np.int8)
    if promote:
        np.put_along_axis(q, pos.astype(np.int64), 0, axis=1)
    parts = _exact_parts(x_raw, n, itemsize, block, scales, pos, exc, q)
    if compact:
        dpos = np.take_along_axis(blocks, pos.astype(np.int64), axis=1)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            ratio = np.where(dpos == 0, 0, dpos / np.where(sc > 0, sc, 0))
            ok = np.abs(ratio) <= OUTLIER_MAX_RATIO  # False for inf and NaN
        far = _flat_positions(pos, block, n, ~ok)  # stored exactly instead
        exc[far] = True
        parts.promo_val = np.where(ok, ratio, 0).astype("<f2").reshape(-1).view(np.uint8)
        parts.exc_idx = np.flatnonzero(exc).astype(np.uint64)
        parts.exc_val = x_raw.reshape(n, itemsize)[exc].reshape(-1).copy()
    rec = _reconstruct(r_raw, parts, dtype, itemsize, block, nonneg, compact)
    rw = _to_work(rec, dtype)
    bad = np.isfinite(x) & ~np.isfinite(rw)  # overflow at the top of the dtype's range
    if bad.any():
        parts.exc_idx = np.flatnonzero(exc | bad).astype(np.uint64)
        parts.exc_val = x_raw.reshape(n, itemsize)[exc | bad].reshape(-1).copy()
        rec = _reconstruct(r_raw, parts, dtype, itemsize, block, nonneg, compact)
        rw = _to_work(rec, dtype)
    return (parts, rec, *_errors(x, rw))


def _quantize_any(x_raw: U8, r_raw: U8, spec: _Spec) -> tuple[_Parts, U8, float, float, float]:
    if spec.domain == "log":
        cap = MAX_LOG_STEP[spec.bits] if spec.max_log_step is None else spec.max_log_step
        return _quantize_log(x_raw, r_raw, spec, cap)
    return _quantize(x_raw, r_raw, spec)


def _errors(x: Work, rw: Work) -> tuple[float, float, float]:
    """Max abs error, relative L2 error and max relative error of ``rw`` against ``x``."""
    fin = np.isfinite(x)
    xf = x[fin].astype(np.float64)
    err = np.abs(xf - rw[fin].astype(np.float64))
    max_err = float(err.max(initial=0.0))
    ax = np.abs(xf)
    peak = float(ax.max(initial=0.0))
    if peak > 0:  # scaled, so that float64 values near the top of the range do not overflow
        rel = float(np.linalg.norm(err / peak)) / float(np.linalg.norm(ax / peak))
    else:
        rel = 0.0 if max_err == 0 else 1.0
    nz = ax > 0
    with np.errstate(over="ignore"):
        max_rel = float((err[nz] / ax[nz]).max(initial=0.0))
    if (err[~nz] > 0).any():
        max_rel = float("inf")  # an error on a zero (linear domain only) has no relative size
    return max_err, rel, max_rel


def _promote_and_scale(
    d: Work, n: int, block: int, promote: int, qmax: int
) -> tuple[Work, npt.NDArray[np.uint16], Work]:
    """Blocks of ``d`` (padded with zeros), the ``promote`` largest |d| positions per block,
    and each block's largest remaining |d| over ``qmax``."""
    nb = -(-n // block)
    dd = np.zeros(nb * block, d.dtype)
    dd[:n] = d
    blocks = dd.reshape(nb, block)
    mag = np.abs(blocks)
    pos: npt.NDArray[np.uint16]
    if promote:
        top = np.argpartition(mag, block - promote, axis=1)[:, block - promote :]
        pos = np.sort(top, axis=1).astype(np.uint16)
        np.put_along_axis(mag, pos.astype(np.int64), 0, axis=1)
    else:
        pos = np.zeros((nb, 0), np.uint16)
    return blocks, pos, mag.max(axis=1, initial=0) / qmax


def _quantize_log(
    x_raw: U8, r_raw: U8, spec: _Spec, max_step: float
) -> tuple[_Parts, U8, float, float, float]:
    """Parts, reconstruction, max abs, relative L2 and max relative error, in the log domain.

    ``max_step`` caps each block's step (log2 units): changes beyond
    ``(qmax + 1/2) * step`` are then stored exactly, so the relative error stays under about
    ``2**(max_step/2) - 1`` whatever a few values of the block do.
    """
    dtype, itemsize, bits, block, promote = spec.grid()
    n = x_raw.nbytes // itemsize
    x, r = _to_work(x_raw, dtype), _to_work(r_raw, dtype)
    tiny = _tiny(dtype)
    with np.errstate(invalid="ignore"):
        log = np.isfinite(x) & np.isfinite(r) & (x >= tiny) & (r >= tiny)
    d = np.zeros(n, np.float64)
    d[log] = np.log2(x[log].astype(np.float64)) - np.log2(r[log].astype(np.float64))
    far = np.abs(d) > LOG_MAX_STEP
    log &= ~far
    d[far] = 0
    uint = _UINT[itemsize]
    same = x_raw.view(uint) == r_raw.view(uint)
    exc = ~log & ~same  # zeros, negatives, subnormals, non-finite: kept if unchanged, else exact
    qm = _qmax(bits)
    blocks, pos, steps = _promote_and_scale(d, n, block, promote, qm)
    steps = np.minimum(steps, max_step)
    factors = np.exp2(steps).astype(_scale_dtype(dtype))  # stored: how it was computed is moot
    step = np.log2(factors.astype(np.float64))[:, None]  # the step the stored factor makes
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(step > 0, np.rint(blocks / np.where(step > 0, step, 1)), 0)
    # a change beyond the grid (the step was capped) is stored exactly
    beyond = (np.abs(blocks) > (qm + 0.5) * step).reshape(-1)[:n]
    q = np.clip(q, -qm, qm).astype(np.int8)
    if promote:
        np.put_along_axis(q, pos.astype(np.int64), 0, axis=1)
        beyond[_flat_positions(pos, block, n)] = False
    exc |= beyond
    q.reshape(-1)[:n][beyond] = 0
    parts = _exact_parts(x_raw, n, itemsize, block, factors, pos, exc, q)
    rec = _reconstruct_log(r_raw, parts, dtype, itemsize, block, bits)
    rw = _to_work(rec, dtype)
    with np.errstate(invalid="ignore"):
        bad = log & ~(np.isfinite(rw) & (rw >= tiny))  # left the positive normal range
    if bad.any():
        parts.exc_idx = np.flatnonzero(exc | bad).astype(np.uint64)
        parts.exc_val = x_raw.reshape(n, itemsize)[exc | bad].reshape(-1).copy()
        rec = _reconstruct_log(r_raw, parts, dtype, itemsize, block, bits)
        rw = _to_work(rec, dtype)
    return (parts, rec, *_errors(x, rw))


def _flat_positions(
    pos: npt.NDArray[np.uint16], block: int, n: int, where: npt.NDArray[np.bool_] | None = None
) -> npt.NDArray[np.int64]:
    """Indices in the piece of the promoted positions (those ``where`` is True; padding
    positions left out)."""
    flat = np.arange(pos.shape[0], dtype=np.int64)[:, None] * block + pos
    if where is not None:
        flat = flat[where]
    flat = flat.reshape(-1)
    return flat[flat < n]


def _exact_parts(
    x_raw: U8,
    n: int,
    itemsize: int,
    block: int,
    scales: Work,
    pos: npt.NDArray[np.uint16],
    exc: npt.NDArray[np.bool_],
    q: npt.NDArray[np.int8],
) -> _Parts:
    nb = scales.size
    xv = x_raw.reshape(n, itemsize)
    flat = (np.arange(nb, dtype=np.int64)[:, None] * block + pos).reshape(-1)
    promo_val = np.zeros((flat.size, itemsize), np.uint8)
    promo_val[flat < n] = xv[flat[flat < n]]
    exc_idx = np.flatnonzero(exc).astype(np.uint64)
    return _Parts(
        scales, pos, promo_val.reshape(-1), exc_idx, xv[exc].reshape(-1).copy(), q.reshape(-1)
    )


def _check_args(bits: int, block: int, promote: int) -> None:
    if bits not in BITS:
        raise ConfigError(f"bits must be one of {BITS}, got {bits}")
    if not 1 <= block <= 65536:
        raise ConfigError(f"block must be in [1, 65536], got {block}")
    if not 0 <= promote < block:
        raise ConfigError(f"promote must be in [0, block), got {promote}")


def _inputs(data: Buffer, dtype: str | torch.dtype, state: QuantState) -> tuple[U8, str, int]:
    name, itemsize = _float_dtype(dtype)
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
        spec = _Spec(
            name, itemsize, bits, block, promote, nonnegative, domain, max_log_step, compact
        )
        _, _, _, rel, _ = _quantize_delta(x, state, spec)
        if rel <= target:
            return bits
    return max(candidates)


def _quantize_delta(
    x: U8, state: QuantState, spec: _Spec
) -> tuple[_Parts, U8, float, float, float]:
    """Check the arguments and quantize ``x``'s delta against the state's reference (the
    previous reconstruction: error feedback)."""
    _check_args(spec.bits, spec.block, spec.promote)
    assert state.ref is not None
    return _quantize_any(x, state.ref, spec)


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
    spec = _Spec(name, itemsize, bits, block, promote, nonnegative, domain, max_log_step, compact)
    parts, rec, max_err, rel, max_rel = _quantize_delta(x, state, spec)
    blob = pack_sections(
        [
            parts.scales.astype(_scale_dtype(name)),
            parts.promo_pos.astype("<u2"),
            parts.promo_val,
            parts.exc_idx.astype("<u8"),
            parts.exc_val,
            _pack(parts.q, bits),
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
    bits, block, promote = p_int(params, "bits"), p_int(params, "block"), p_int(params, "promote")
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
        nb * np.dtype(_scale_dtype(name)).itemsize,
        nb * promote * 2,
        nb * promote * (2 if compact else itemsize),
        nexc * 8,
        nexc * itemsize,
        -(-nb * block // (8 // bits)),
    ]
    inner = p_dict(params, "inner")
    if p_str(inner, "codec") != LOSSLESS or p_int(inner, "nbytes") != 8 + 8 * 6 + sum(sizes):
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
    scales = np.frombuffer(secs[0], _scale_dtype(name)).astype(_scale_dtype(name))
    if not np.all(np.isfinite(scales)):
        raise CorruptCheckpointError("quantized delta has non-finite scales")
    if log and scales.size and not (scales.min() >= 1 and scales.max() <= 2.0**LOG_MAX_STEP):
        raise CorruptCheckpointError("log-domain quantized delta has factors outside [1, 2**64]")
    if compact and not np.all(np.abs(np.frombuffer(secs[2], "<f2")) <= OUTLIER_MAX_RATIO):
        raise CorruptCheckpointError("quantized delta has outliers beyond their range")
    parts = _Parts(
        scales,
        pos.astype(np.uint16),
        np.frombuffer(secs[2], np.uint8),
        exc_idx.astype(np.uint64),
        np.frombuffer(secs[4], np.uint8),
        _unpack(np.frombuffer(secs[5], np.uint8), bits, nb * block),
    )
    if log:
        dst[:] = _reconstruct_log(ref, parts, name, itemsize, block, bits)
    else:
        dst[:] = _reconstruct(ref, parts, name, itemsize, block, nonneg, compact)
    check_result(params, dst)
