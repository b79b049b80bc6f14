"""Log-domain quantized delta (coci.qdelta-log/1) and compact outliers (coci.qdelta/2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coci_core.codecs import QuantState, decode, encode_lossless, encode_quantized
from coci_core.codecs._common import pack_sections, unpack_sections
from coci_core.codecs.lossless import decode_lossless
from coci_core.codecs.quantizer import MAX_LOG_STEP
from coci_core.errors import CorruptCheckpointError
from tests.codecs.helpers import FLOATS, States, as_float64

_RANGE = {"float16": (-4, 4), "bfloat16": (-30, 30), "float32": (-30, 30), "float64": (-300, 300)}
_MAX = {"float16": 6e4, "bfloat16": 1e38, "float32": 1e38, "float64": 1e307}


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    if values.size == 0:
        return np.zeros(0, np.uint8)
    return torch.from_numpy(values).to(getattr(torch, dtype)).view(torch.uint8).numpy().copy()


def _positive(dtype: str, n: int, seed: int, zeros: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """A non-negative tensor over many orders of magnitude (with exact zeros) and a later
    version of it (each value times exp(N(0, 0.1)), zeros kept, a few values appearing)."""
    rng = np.random.default_rng(seed)
    lo, hi = _RANGE[dtype]
    base = 10.0 ** rng.uniform(lo, hi, n)
    base[rng.random(n) < zeros] = 0.0
    x = base * np.exp(rng.normal(0, 0.1, n))
    x[rng.random(n) < 0.01] *= 1e6  # a few jump far beyond any block's step
    born = (base == 0) & (rng.random(n) < 0.05)  # a zero that becomes positive
    x[born] = 10.0 ** rng.uniform(lo, hi, int(born.sum()))
    return _cast(base, dtype), _cast(np.minimum(x, _MAX[dtype]), dtype)


def _roundtrip(
    x: np.ndarray, base: np.ndarray, dtype: str, **kw: object
) -> tuple[np.ndarray, dict[str, object]]:
    state = QuantState()
    state.reset(base, step=3)
    enc = encode_quantized(x, dtype, state, domain="log", **kw)  # type: ignore[arg-type]
    assert json.loads(json.dumps(enc.params, allow_nan=False)) == enc.params
    out = np.empty_like(x)
    decode(enc.data, enc.params, out, base)
    assert np.array_equal(out, state._pending[0])  # type: ignore[index]  # decoder = encoder
    return out, enc.params


def _rel_err(x: np.ndarray, out: np.ndarray, dtype: str) -> np.ndarray:
    a, b = as_float64(x, dtype), as_float64(out, dtype)
    nz = a != 0
    return np.abs(a[nz] - b[nz]) / np.abs(a[nz])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_relative_error_within_recorded_bound_and_positives_stay_positive(
    dtype: str, bits: int
) -> None:
    base, x = _positive(dtype, 20_000, seed=bits)
    out, params = _roundtrip(x, base, dtype, bits=bits)
    a, b = as_float64(x, dtype), as_float64(out, dtype)
    assert params["codec"] == "coci.qdelta-log/1" and params["bits"] == bits
    rel = _rel_err(x, out, dtype)
    assert rel.max() <= params["max_rel_error"]
    assert rel.max() == params["max_rel_error"]  # measured, so attained: a tight bound
    # the bound is the cap's: about 2**(cap/2) - 1, whatever the magnitudes and jumps
    assert params["max_rel_error"] <= 2 ** (MAX_LOG_STEP[bits] / 2) - 1 + 2.0**-7
    assert (b[a > 0] > 0).all()  # never a positive reconstructed as 0 (or below)
    assert (b[a == 0] == 0).all()  # exact zeros stay exactly zero
    assert np.abs(a - b).max() <= params["max_abs_error"]
    # the values were really quantized (not all exceptions), at a real compression
    assert params["exceptions"] < 0.05 * a.size
    assert rel.max() > 0


def test_beyond_the_cap_is_exact_and_the_cap_bounds_the_error() -> None:
    rng = np.random.default_rng(0)
    base = (10.0 ** rng.uniform(-12, -2, 4096)).astype(np.float32)
    x = base * np.exp(rng.normal(0, 0.05, base.size)).astype(np.float32)
    x[::256] *= np.float32(1e5)  # one value per block jumps by 2**16.6
    x[1::256] *= np.float32(8)  # and one by 2**3
    out, params = _roundtrip(x.view(np.uint8), base.view(np.uint8), "float32", bits=2, promote=0)
    y = out.view(np.float32)
    assert np.array_equal(y[::256], x[::256])  # stored exactly
    assert np.array_equal(y[1::256], x[1::256])
    assert params["exceptions"] >= 32
    assert params["max_rel_error"] <= 2**0.25 - 1  # the jumps did not widen the blocks' step
    # without the cap (64 = at most 2**64 per save) the big jump sets its block's step and the
    # 2**3 change rounds to no change: 7/8 off
    _, wide = _roundtrip(
        x.view(np.uint8), base.view(np.uint8), "float32", bits=2, promote=0, max_log_step=64
    )
    assert wide["max_rel_error"] >= 0.875 - 1e-3


def test_unchanged_and_special_values_are_kept() -> None:
    base = np.array([0.0, -0.0, -1.0, np.inf, np.nan, 1e-45, 1.0, 2.0] * 64, np.float32)
    x = base.copy()
    x[6::8] = 1.5  # 1.0 -> 1.5
    x[2::16] = -3.0  # a negative that changed: exact
    out, params = _roundtrip(x.view(np.uint8), base.view(np.uint8), "float32", bits=2)
    assert np.array_equal(
        out.view(np.uint32)[np.arange(x.size) % 8 != 6],
        x.view(np.uint32)[np.arange(x.size) % 8 != 6],
    )  # bit for bit: signed zeros, NaN payload, subnormals, negatives
    assert params["exceptions"] == 32


def test_error_feedback_chain_in_the_log_domain() -> None:
    rng = np.random.default_rng(1)
    v = (10.0 ** rng.uniform(-10, -2, 50_000)).astype(np.float32)
    state = QuantState()
    state.reset(v.view(np.uint8), step=0)
    restored = v.view(np.uint8).copy()
    for step in range(1, 11):  # Adam-like: decay plus fresh squared gradients
        g2 = (rng.normal(0, 1, v.size) ** 2 * 10.0 ** rng.uniform(-10, -2, v.size)).astype(
            np.float32
        )
        v = (0.99 * v + 0.01 * g2).astype(np.float32)
        enc = encode_quantized(v.view(np.uint8), "float32", state, bits=2, domain="log", step=step)
        out = np.empty_like(restored)
        decode(enc.data, enc.params, out, restored)
        state.commit()
        assert np.array_equal(state.ref, out)
        restored = out
        y = out.view(np.float32)
        assert (y > 0).all()
        rel = np.abs(y.astype(np.float64) - v) / v
        assert rel.max() <= enc.params["max_rel_error"] <= 2**0.25 - 1


@pytest.mark.parametrize("dtype", FLOATS)
def test_real_second_moments_in_every_float_dtype(digits: States, dtype: str) -> None:
    def cast(a: np.ndarray) -> np.ndarray:
        return _cast(a.reshape(-1).astype(np.float64), dtype)

    for key in [k for k in digits[10] if k.endswith("exp_avg_sq")]:
        base, x = cast(digits[10][key]), cast(digits[20][key])
        for bits in (2, 8):
            out, params = _roundtrip(x, base, dtype, bits=bits)
            a, b = as_float64(x, dtype), as_float64(out, dtype)
            assert (b[a > 0] > 0).all() and (b[a == 0] == 0).all(), key
            assert _rel_err(x, out, dtype).max(initial=0) <= params["max_rel_error"]


def test_real_second_moments_compress(digits: States) -> None:
    """One step apart, 2 bits: 4.5x. (This early in training most second moments move by more
    than the 2-bit cap allows between saves 10 steps apart and are stored exactly: 1.2-1.3x
    for steps 20 -> 30 and 30 -> 40.)"""
    keys = [k for k in digits[10] if k.endswith("exp_avg_sq")]
    x = np.concatenate([digits[11][k].reshape(-1) for k in keys]).view(np.uint8)
    base = np.concatenate([digits[10][k].reshape(-1) for k in keys]).view(np.uint8)
    state = QuantState()
    state.reset(base)
    enc = encode_quantized(x, "float32", state, bits=2, domain="log", promote=0)
    assert x.nbytes / enc.nbytes > 4


def _tamper_sections(enc_data: bytes, params: dict, index: int, new: np.ndarray) -> tuple:  # type: ignore[type-arg]
    inner = params["inner"]
    blob = np.empty(inner["nbytes"], np.uint8)
    decode_lossless(enc_data, inner, blob)
    secs = [np.frombuffer(s, np.uint8).copy() for s in unpack_sections(blob, 6)]
    secs[index] = new.view(np.uint8)
    re = encode_lossless(np.frombuffer(pack_sections(secs), np.uint8), "uint8", level=3)
    return re.data, {**params, "inner": re.params}


def test_corrupt_parameters_are_rejected() -> None:
    base, x = _positive("float32", 3000, seed=7)
    state = QuantState()
    state.reset(base)
    enc = encode_quantized(x, "float32", state, bits=2, domain="log")
    out = np.empty_like(x)
    decode(enc.data, enc.params, out, base)  # intact: decodes
    bad_values = [
        ("max_rel_error", -0.1),
        ("max_rel_error", "0.1"),
        ("max_rel_error", True),
        ("max_rel_error", 1e400),  # inf
        ("max_abs_error", -1.0),
        ("rel_error", None),
        ("exact", True),
        ("generation", 0),
        ("bits", 3),
        ("block", 0),
        ("promote", 300),
        ("dtype", "int32"),
        ("itemsize", 2),
        ("exceptions", 10**9),
        ("codec", "coci.qdelta/1"),  # same sections, read linearly: the hash catches it
        ("codec", "coci.qdelta-log/9"),
    ]
    for key, value in bad_values:
        with pytest.raises(CorruptCheckpointError):
            decode(enc.data, {**enc.params, key: value}, out, base)
    missing = {k: v for k, v in enc.params.items() if k != "max_rel_error"}
    with pytest.raises(CorruptCheckpointError, match="max_rel_error"):
        decode(enc.data, missing, out, base)
    # a factor below 1 or beyond 2**64 in the stored sections
    nb = -(-(x.nbytes // 4) // 256)
    for factor in (0.5, 2.0**65, np.nan):
        data, params = _tamper_sections(bytes(enc.data), enc.params, 0, np.full(nb, factor, "<f4"))
        with pytest.raises(CorruptCheckpointError):
            decode(data, params, out, base)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, None)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(min_value=0, max_value=3000),
    bits=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([16, 256, 4096]),
    promote=st.integers(min_value=0, max_value=4),
    zeros=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_log_bound_holds_for_any_positive_tensor(
    dtype: str, n: int, bits: int, block: int, promote: int, zeros: float, seed: int
) -> None:
    base, x = _positive(dtype, n, seed=seed, zeros=zeros)
    out, params = _roundtrip(x, base, dtype, bits=bits, block=block, promote=promote)
    a, b = as_float64(x, dtype), as_float64(out, dtype)
    assert _rel_err(x, out, dtype).max(initial=0) <= params["max_rel_error"]
    assert (b[a > 0] > 0).all() and (b[a == 0] == 0).all()


# --- coci.qdelta/2: outliers as float16 multiples of the block's scale ---------------------


def test_compact_outliers_are_smaller_and_within_bound(digits: States) -> None:
    x = np.concatenate([a.reshape(-1) for a in digits[20].values()]).view(np.uint8)
    base = np.concatenate([a.reshape(-1) for a in digits[10].values()]).view(np.uint8)
    sizes = {}
    for exact in (True, False):
        state = QuantState()
        state.reset(base)
        enc = encode_quantized(x, "float32", state, bits=2, exact_outliers=exact)
        out = np.empty_like(x)
        decode(enc.data, enc.params, out, base)
        err = np.abs(out.view(np.float32).astype(np.float64) - x.view(np.float32)).max()
        assert err <= enc.params["max_abs_error"]
        assert enc.params["codec"] == ("coci.qdelta/1" if exact else "coci.qdelta/2")
        sizes[exact] = enc.nbytes
    assert sizes[False] < 0.9 * sizes[True]


def test_compact_outlier_beyond_its_range_is_exact() -> None:
    base = np.zeros(1024, np.float32)
    x = base.copy()
    x[1::2] = 1e-3
    x[::256] = 1e4  # 1e7 block scales: beyond float16's 1024-scale range, stored exactly
    x[128::256] = 0.5  # 500 scales: a float16 multiple
    state = QuantState()
    state.reset(base.view(np.uint8))
    enc = encode_quantized(x.view(np.uint8), "float32", state, bits=2, promote=2)
    out = np.empty_like(x.view(np.uint8))
    decode(enc.data, enc.params, out, base.view(np.uint8))
    y = out.view(np.float32)
    assert np.array_equal(y[::256], x[::256])
    assert enc.params["exceptions"] == 4
    assert np.abs(y[128::256] - 0.5).max() <= 1e-3 / 2  # half a scale at most
    assert enc.params["max_abs_error"] <= 1e-3 / 2
    # a tampered outlier beyond the range is refused
    data, params = _tamper_sections(bytes(enc.data), enc.params, 2, np.full(8, 2000.0, "<f2"))
    with pytest.raises(CorruptCheckpointError, match="outliers"):
        decode(data, params, out, base.view(np.uint8))
