"""The quantizer behind ``coci.qdelta``: float views, blocks and their scales (or log-domain
factors), priority promotion of the largest changes, exact overwrites, bit packing, and the
reconstruction the decoder repeats bit for bit (see :mod:`coci_core.codecs.quantized`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from coci_core.codecs._common import (
    FLOAT_DTYPES,
    U8,
    dtype_name,
)
from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = [
    "BITS",
    "Domain",
    "LOG_MAX_STEP",
    "MAX_LOG_STEP",
    "OUTLIER_MAX_RATIO",
    "Parts",
    "Spec",
    "Work",
    "float_dtype",
    "from_work",
    "pack_bits",
    "quantize_blocks",
    "reconstruct",
    "reconstruct_log",
    "scale_dtype",
    "to_work",
    "unpack_bits",
]

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


# --- float views ------------------------------------------------------------------------


def to_work(raw: U8, dtype: str) -> Work:
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "float32":
        return raw.view("<f4").astype(np.float32)
    return raw.view("<f8").astype(np.float64)


def from_work(w: Work, dtype: str) -> U8:
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


def float_dtype(dtype: str | torch.dtype) -> tuple[str, int]:
    name = dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"quantized delta needs a float dtype, got {name!r}")
    return name, FLOAT_DTYPES[name]


# --- the shared reconstruction (encoder simulates exactly what the decoder does) ---------


def scale_dtype(dtype: str) -> str:
    return "<f8" if dtype == "float64" else "<f4"


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def pack_bits(q: npt.NDArray[np.int8], bits: int) -> U8:
    u = (q.astype(np.int16) + _qmax(bits)).astype(np.uint8)
    per = 8 // bits
    u = np.concatenate([u, np.zeros(-u.size % per, np.uint8)]).reshape(-1, per)
    out = np.zeros(u.shape[0], np.uint8)
    for j in range(per):
        out |= u[:, j] << np.uint8(j * bits)
    return out


def unpack_bits(packed: U8, bits: int, count: int) -> npt.NDArray[np.int8]:
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
class Parts:
    scales: Work  # (nblocks,) float32, or float64 for float64 pieces (deltas beyond float32)
    promo_pos: npt.NDArray[np.uint16]  # (nblocks, promote) positions within the block
    # (nblocks * promote * itemsize) exact bytes (coci.qdelta/1, log domain), or float16
    # multiples of the block's scale (coci.qdelta/2); padding positions hold zeros
    promo_val: U8
    exc_idx: npt.NDArray[np.uint64]  # indices stored exactly (non-finite values and bases)
    exc_val: U8
    q: npt.NDArray[np.int8]  # (nblocks * block,)


def _overwrite_exact(
    out: U8, parts: Parts, n: int, itemsize: int, block: int, promoted: bool = True
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


def reconstruct(
    ref: U8,
    parts: Parts,
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
    r = to_work(ref, dtype)
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
        out = from_work(w, dtype).copy()
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


def reconstruct_log(ref: U8, parts: Parts, dtype: str, itemsize: int, block: int, bits: int) -> U8:
    """``ref * f**q`` where ``q != 0``, ``ref``'s own bytes elsewhere, then the exact values."""
    n = ref.nbytes // itemsize
    out = ref.copy()
    q = parts.q[:n]
    idx = np.flatnonzero(q)
    if idx.size:
        f = parts.scales.astype(np.float64)[idx // block]
        r = to_work(ref, dtype)[idx].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            w = r * _powers(f, q[idx], bits)
            out.reshape(n, itemsize)[idx] = from_work(w, dtype).reshape(-1, itemsize)
    _overwrite_exact(out, parts, n, itemsize, block)
    return out


def _tiny(dtype: str) -> float:
    """The smallest positive normal number of ``dtype``."""
    return {"float16": 2.0**-14, "float64": 2.0**-1022}.get(dtype, 2.0**-126)


@dataclass(frozen=True)
class Spec:
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


def _quantize(x_raw: U8, r_raw: U8, spec: Spec) -> tuple[Parts, U8, float, float, float]:
    """Parts, reconstruction, max abs, relative L2 and max relative error of a linear delta
    (``spec.compact``: outliers as float16 multiples of the block's scale, coci.qdelta/2)."""
    dtype, itemsize, bits, block, promote = spec.grid()
    nonneg, compact = spec.nonneg, spec.compact
    n = x_raw.nbytes // itemsize
    x, r = to_work(x_raw, dtype), to_work(r_raw, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        d = x - r
    exc = ~(np.isfinite(x) & np.isfinite(r) & np.isfinite(d))
    d[exc] = 0
    qm = _qmax(bits)
    blocks, pos, mx = _promote_and_scale(d, n, block, promote, qm)
    scales = mx.astype(scale_dtype(dtype))
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
    rec = reconstruct(r_raw, parts, dtype, itemsize, block, nonneg, compact)
    rw = to_work(rec, dtype)
    bad = np.isfinite(x) & ~np.isfinite(rw)  # overflow at the top of the dtype's range
    if bad.any():
        parts.exc_idx = np.flatnonzero(exc | bad).astype(np.uint64)
        parts.exc_val = x_raw.reshape(n, itemsize)[exc | bad].reshape(-1).copy()
        rec = reconstruct(r_raw, parts, dtype, itemsize, block, nonneg, compact)
        rw = to_work(rec, dtype)
    return (parts, rec, *_errors(x, rw))


def quantize_blocks(x_raw: U8, r_raw: U8, spec: Spec) -> tuple[Parts, U8, float, float, float]:
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
    x_raw: U8, r_raw: U8, spec: Spec, max_step: float
) -> tuple[Parts, U8, float, float, float]:
    """Parts, reconstruction, max abs, relative L2 and max relative error, in the log domain.

    ``max_step`` caps each block's step (log2 units): changes beyond
    ``(qmax + 1/2) * step`` are then stored exactly, so the relative error stays under about
    ``2**(max_step/2) - 1`` whatever a few values of the block do.
    """
    dtype, itemsize, bits, block, promote = spec.grid()
    n = x_raw.nbytes // itemsize
    x, r = to_work(x_raw, dtype), to_work(r_raw, dtype)
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
    factors = np.exp2(steps).astype(scale_dtype(dtype))  # stored: how it was computed is moot
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
    rec = reconstruct_log(r_raw, parts, dtype, itemsize, block, bits)
    rw = to_work(rec, dtype)
    with np.errstate(invalid="ignore"):
        bad = log & ~(np.isfinite(rw) & (rw >= tiny))  # left the positive normal range
    if bad.any():
        parts.exc_idx = np.flatnonzero(exc | bad).astype(np.uint64)
        parts.exc_val = x_raw.reshape(n, itemsize)[exc | bad].reshape(-1).copy()
        rec = reconstruct_log(r_raw, parts, dtype, itemsize, block, bits)
        rw = to_work(rec, dtype)
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
) -> Parts:
    nb = scales.size
    xv = x_raw.reshape(n, itemsize)
    flat = (np.arange(nb, dtype=np.int64)[:, None] * block + pos).reshape(-1)
    promo_val = np.zeros((flat.size, itemsize), np.uint8)
    promo_val[flat < n] = xv[flat[flat < n]]
    exc_idx = np.flatnonzero(exc).astype(np.uint64)
    return Parts(
        scales, pos, promo_val.reshape(-1), exc_idx, xv[exc].reshape(-1).copy(), q.reshape(-1)
    )
