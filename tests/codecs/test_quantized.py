"""Lossy quantized delta (coci.qdelta/1): bounds, error feedback, bits, corruption."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coci_core.codecs import QuantState, choose_bits, decode, encode_quantized
from coci_core.codecs.quantizer import from_work, to_work
from coci_core.errors import ConfigError, CorruptCheckpointError
from tests.codecs.helpers import FLOATS, States, as_float64, float_bytes


def _values(raw: np.ndarray, dtype: str) -> np.ndarray:
    return as_float64(raw, dtype)


def _perturb(raw: np.ndarray, dtype: str, scale: float, seed: int) -> np.ndarray:
    """``raw`` plus N(0, scale) noise, in ``dtype`` (non-finite entries kept)."""
    if raw.size == 0:
        return raw.copy()
    t = torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, dtype)).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    t = t + torch.randn(t.shape, generator=g, dtype=torch.float64) * scale
    return t.to(getattr(torch, dtype)).view(torch.uint8).numpy().copy()


def _encode_decode(
    x: np.ndarray, base: np.ndarray, dtype: str, **kw: object
) -> tuple[np.ndarray, dict[str, object]]:
    state = QuantState()
    state.reset(base, step=5)
    enc = encode_quantized(x, dtype, state, **kw)  # type: ignore[arg-type]
    assert json.loads(json.dumps(enc.params, allow_nan=False)) == enc.params
    out = np.empty_like(x)
    decode(enc.data, enc.params, out, base)
    return out, enc.params


def _max_err(x: np.ndarray, y: np.ndarray, dtype: str) -> float:
    a, b = _values(x, dtype), _values(y, dtype)
    fin = np.isfinite(a)
    return float(np.abs(a[fin] - b[fin]).max(initial=0.0))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 300, 5000])
def test_error_within_recorded_bound_random(dtype: str, bits: int, n: int) -> None:
    base = float_bytes(dtype, n, seed=n, special=False)
    x = _perturb(base, dtype, 1e-3, seed=bits)
    out, params = _encode_decode(x, base, dtype, bits=bits, block=256, promote=4)
    err = _max_err(x, out, dtype)
    assert err <= params["max_abs_error"]
    assert params["exact"] is False and params["bits"] == bits
    assert params["base"] is True and params["base_step"] == 5 and params["generation"] == 1
    # the bound is tight (measured), not a loose guess: it is attained
    assert err == params["max_abs_error"]


def test_fewer_bits_smaller_and_less_accurate() -> None:
    base = float_bytes("float32", 20000, special=False)
    x = _perturb(base, "float32", 1e-3, seed=1)
    sizes, errs = [], []
    for bits in (8, 4, 2):
        state = QuantState()
        state.reset(base)
        enc = encode_quantized(x, "float32", state, bits=bits)
        sizes.append(enc.nbytes)
        errs.append(enc.params["rel_error"])
    assert sizes[0] > sizes[1] > sizes[2]
    assert errs[0] < errs[1] < errs[2]
    assert x.nbytes / sizes[2] > 10


@pytest.mark.parametrize("dtype", FLOATS)
def test_non_finite_and_special_values_are_exact(dtype: str) -> None:
    base = float_bytes(dtype, 3000, seed=1, special=True)
    x = float_bytes(dtype, 3000, seed=2, special=True)
    out, params = _encode_decode(x, base, dtype, bits=4)
    a, b = _values(x, dtype), _values(out, dtype)
    nonfinite = ~np.isfinite(a)
    assert nonfinite.any()
    isz = {"float16": "<u2", "bfloat16": "<u2", "float32": "<u4", "float64": "<u8"}[dtype]
    assert np.array_equal(x.view(isz)[nonfinite], out.view(isz)[nonfinite])  # NaN payloads too
    assert params["exceptions"] >= int(nonfinite.sum())
    assert np.abs(a[~nonfinite] - b[~nonfinite]).max() <= params["max_abs_error"]


def test_promotion_keeps_the_largest_changes_exact() -> None:
    base = np.zeros(1024, np.float32)
    x = base.copy()
    x[::256] = 1000.0  # one outlier per block
    x[1::2] = 1e-3
    out, params = _encode_decode(x.view(np.uint8), base.view(np.uint8), "float32", promote=1)
    y = out.view(np.float32)
    assert np.array_equal(y[::256], x[::256])
    # without promotion the outlier sets the scale and the small changes vanish
    assert params["max_abs_error"] < 1e-5
    _, no_promo = _encode_decode(x.view(np.uint8), base.view(np.uint8), "float32", promote=0)
    assert no_promo["max_abs_error"] > 1e-4


def test_nonnegative_clamps_reconstruction() -> None:
    rng = np.random.default_rng(0)
    base = (rng.random(4096) * 1e-8).astype(np.float32)
    x = np.maximum(base + rng.normal(0, 1e-8, 4096).astype(np.float32), 0).astype(np.float32)
    out, params = _encode_decode(
        x.view(np.uint8), base.view(np.uint8), "float32", bits=2, nonnegative=True
    )
    assert (out.view(np.float32) >= 0).all()
    assert params["nonnegative"] is True
    out2, _ = _encode_decode(x.view(np.uint8), base.view(np.uint8), "float32", bits=2)
    assert (out2.view(np.float32) < 0).any()  # the clamp is what keeps it non-negative


def test_real_digits_deltas_within_bound(digits: States) -> None:
    for key in digits[10]:
        base = digits[10][key].reshape(-1).view(np.uint8)
        for later in (11, 20, 40):
            x = digits[later][key].reshape(-1).view(np.uint8)
            for bits in (2, 4, 8):
                out, params = _encode_decode(
                    x, base, "float32", bits=bits, nonnegative=key.endswith("_sq")
                )
                assert _max_err(x, out, "float32") <= params["max_abs_error"], (key, later)


def test_real_digits_compression(digits: States) -> None:
    x = np.concatenate([a.reshape(-1) for a in digits[11].values()]).view(np.uint8)
    base = np.concatenate([a.reshape(-1) for a in digits[10].values()]).view(np.uint8)
    _, p2 = _encode_decode(x, base, "float32", bits=2)
    state = QuantState()
    state.reset(base)
    assert x.nbytes / encode_quantized(x, "float32", state, bits=2).nbytes > 10
    assert p2["rel_error"] < 0.05


def _walk(saves: int = 10) -> tuple[list[float], list[float]]:
    """Actual and recorded max errors of ``saves`` successive lossy saves of a drifting tensor."""
    rng = np.random.default_rng(42)
    x = rng.normal(0, 1, 50_000).astype(np.float32)
    state = QuantState()
    state.reset(x.view(np.uint8), step=0)
    restored = x.view(np.uint8).copy()  # what a restore of the chain yields
    actual, bounds = [], []
    drift = rng.normal(0, 1e-3, x.size).astype(np.float32)  # a persistent direction, like SGD
    for step in range(1, saves + 1):
        x = (x + drift + rng.normal(0, 1e-4, x.size)).astype(np.float32)
        enc = encode_quantized(x.view(np.uint8), "float32", state, bits=2, step=step)
        assert enc.params["base_step"] == step - 1
        out = np.empty_like(restored)
        decode(enc.data, enc.params, out, restored)
        state.commit()
        assert state.generation == step and state.ref_step == step
        assert np.array_equal(state.ref, out)  # the encoder's reference is the decoder's view
        restored = out
        actual.append(float(np.abs(out.view(np.float32) - x).max()))
        bounds.append(float(enc.params["max_abs_error"]))  # type: ignore[arg-type]
    return actual, bounds


def test_error_feedback_keeps_chain_error_bounded() -> None:
    actual, bounds = _walk()
    assert all(a <= b for a, b in zip(actual, bounds, strict=True))
    # each save's error is its own quantization error: the 10th is no worse than 2x the first
    # (a delta against the true previous values instead would let the errors pile up)
    assert max(actual) <= 2 * actual[0]


def test_choose_bits_follows_sensitivity() -> None:
    base = float_bytes("float32", 20000, special=False)
    state = QuantState()
    state.reset(base)
    tiny = _perturb(base, "float32", 1e-7, seed=1)
    large = _perturb(base, "float32", 1e-2, seed=1)
    assert choose_bits(tiny, "float32", state, target=1e-3) == 2
    assert choose_bits(large, "float32", state, target=1e-3) == 8
    mid_bits = choose_bits(large, "float32", state, target=0.05)
    enc = encode_quantized(large, "float32", state, bits="auto", target=0.05)
    assert enc.params["bits"] == mid_bits
    assert enc.params["rel_error"] <= 0.05  # type: ignore[operator]


def test_state_misuse_is_a_config_error() -> None:
    x = float_bytes("float32", 100, special=False)
    state = QuantState()
    with pytest.raises(ConfigError):
        encode_quantized(x, "float32", state)
    with pytest.raises(ConfigError):
        state.commit()
    state.reset(x)
    with pytest.raises(ConfigError):
        encode_quantized(x[:-4], "float32", state)
    with pytest.raises(ConfigError):
        encode_quantized(x, "int32", state)
    with pytest.raises(ConfigError):
        encode_quantized(x, "float32", state, bits=3)


def test_uncommitted_save_leaves_reference() -> None:
    base = float_bytes("float32", 1000, special=False)
    state = QuantState()
    state.reset(base, step=1)
    encode_quantized(_perturb(base, "float32", 1e-2, 0), "float32", state, step=2)
    assert state.ref_step == 1 and np.array_equal(state.ref, base)


def test_corruption_is_detected() -> None:
    base = float_bytes("float16", 3000, special=False)
    x = _perturb(base, "float16", 1e-2, seed=0)
    state = QuantState()
    state.reset(base)
    enc = encode_quantized(x, "float16", state, bits=4)
    out = np.empty_like(x)
    stored = bytes(enc.data)
    wrong_base = base.copy()
    wrong_base[10] ^= 1
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, wrong_base)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, None)
    with pytest.raises(CorruptCheckpointError):
        decode(stored[:-2], enc.params, out, base)
    for key, value in [("bits", 3), ("block", 0), ("dtype", "int8"), ("exceptions", 10**9)]:
        with pytest.raises(CorruptCheckpointError):
            decode(enc.data, {**enc.params, key: value}, out, base)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, {**enc.params, "promote": 5}, out, base)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(min_value=0, max_value=3000),
    scale=st.sampled_from([0.0, 1e-6, 1e-3, 1.0, 1e4, 1e300]),
    bits=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([16, 256, 4096]),
    promote=st.integers(min_value=0, max_value=8),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_bound_holds_for_any_delta(
    dtype: str, n: int, scale: float, bits: int, block: int, promote: int, seed: int
) -> None:
    base = float_bytes(dtype, n, seed=seed, special=seed % 3 == 0)
    x = _perturb(base, dtype, scale, seed + 1)
    out, params = _encode_decode(x, base, dtype, bits=bits, block=block, promote=promote)
    assert _max_err(x, out, dtype) <= params["max_abs_error"]
    if not np.isfinite(params["max_abs_error"]):  # type: ignore[arg-type]
        pytest.fail("bound must be finite")


def test_bfloat16_rounding_matches_torch() -> None:
    w = torch.randn(100_000, dtype=torch.float32) * 10.0 ** torch.randint(-30, 30, (100_000,))
    w[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 3.4e38])
    ours = from_work(w.numpy(), "bfloat16").view("<u2")
    theirs = w.to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    same = ours == theirs
    assert same[4:].all() and same[1:4].all()
    assert np.isnan(to_work(ours.view(np.uint8)[:2], "bfloat16")[0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_real_digits_deltas_in_every_float_dtype(digits: States, dtype: str) -> None:
    def cast(a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a.reshape(-1)).to(getattr(torch, dtype))
        return t.view(torch.uint8).numpy().copy()

    for key in ("model.5.weight", "optim.5.weight.exp_avg", "optim.5.weight.exp_avg_sq"):
        base, x = cast(digits[10][key]), cast(digits[20][key])
        for bits in (2, 8):
            out, params = _encode_decode(x, base, dtype, bits=bits, nonnegative=key.endswith("sq"))
            assert _max_err(x, out, dtype) <= params["max_abs_error"]
            assert params["rel_error"] < (0.5 if bits == 2 else 0.05), (key, bits)
