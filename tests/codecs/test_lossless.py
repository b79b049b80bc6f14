"""Exact codecs: coci.zstd/1, coci.xor-zstd/1, coci.chunks/1 (and raw through decode())."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coci_core.codecs import (
    Encoded,
    chunk_hashes,
    decode,
    encode_chunked,
    encode_lossless,
    encode_xor,
    needs_base,
    stored_hashes,
)
from coci_core.codecs.chunked import merkle_root
from coci_core.errors import ConfigError, CorruptCheckpointError
from tests.codecs.helpers import FLOATS, States, float_bytes

# codec under test: (data, base, dtype) -> Encoded; base is None for codecs that take none
Enc = Callable[[np.ndarray, np.ndarray, str], Encoded]
CODECS: dict[str, Enc] = {
    "zstd": lambda a, b, dt: encode_lossless(a, dt, segment=4096),
    "zstd-threads": lambda a, b, dt: encode_lossless(a, dt, segment=1024, threads=2, level=3),
    "zstd-noshuffle": lambda a, b, dt: encode_lossless(a, dt, shuffle=False),
    "xor": lambda a, b, dt: encode_xor(a, b, dt, base_step=7, segment=4096),
    "chunks": lambda a, b, dt: encode_chunked(
        a, dt, base_hashes=chunk_hashes(b, 1024), chunk=1024, base_step=7
    ),
    "chunks-raw": lambda a, b, dt: encode_chunked(
        a, dt, base_hashes=chunk_hashes(b, 1024), chunk=1024, compress=False
    ),
    "chunks-nobase": lambda a, b, dt: encode_chunked(a, dt, base_hashes=None, chunk=1024),
}


def _roundtrip(name: str, data: np.ndarray, base: np.ndarray, dtype: str) -> Encoded:
    enc = CODECS[name](data, base, dtype)
    assert json.loads(json.dumps(enc.params, allow_nan=False)) == enc.params
    out = np.full(data.nbytes, 0xAB, np.uint8)
    decode(enc.data, enc.params, out, base if needs_base(enc.params) else None)
    assert out.tobytes() == data.tobytes()
    return enc


def _changed(data: np.ndarray, frac: float, seed: int = 1) -> np.ndarray:
    """``data`` with a fraction of its bytes changed (a plausible base)."""
    base = data.copy()
    rng = np.random.default_rng(seed)
    idx = rng.choice(base.size, size=int(base.size * frac), replace=False) if base.size else []
    base[idx] ^= 0x5A
    return base


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 5003])
def test_floats_roundtrip_bit_exact(name: str, dtype: str, n: int) -> None:
    data = float_bytes(dtype, n, seed=n)
    enc = _roundtrip(name, data, _changed(data, 0.3), dtype)
    assert enc.params["nbytes"] == data.nbytes
    assert enc.params["exact"] is True


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int32", "int64"])
def test_ints_and_bools_roundtrip(name: str, dtype: str) -> None:
    t = torch.randint(0, 2 if dtype == "bool" else 100, (3001,)).to(getattr(torch, dtype))
    data = t.view(torch.uint8).numpy().copy()
    enc = _roundtrip(name, data, _changed(data, 0.01), dtype)
    assert enc.params["itemsize"] == t.element_size()


@pytest.mark.parametrize("name", CODECS)
def test_byte_ranges_of_an_array(name: str) -> None:
    """Pieces at 64-byte offsets, ending anywhere (even mid-element), decode on their own."""
    whole = float_bytes("float32", 4000)
    base = _changed(whole, 0.2)
    for lo, hi in [(0, 64), (64, 6400), (128, 16000), (6400, 6403), (64, 64)]:
        _roundtrip(name, whole[lo:hi], base[lo:hi], "float32")


def test_shuffle_pays_on_floats_and_is_off_for_ints() -> None:
    data = float_bytes("float32", 100_000, special=False)
    shuffled = encode_lossless(data, "float32")
    plain = encode_lossless(data, "float32", shuffle=False)
    assert shuffled.params["shuffle"] is True
    assert shuffled.nbytes < plain.nbytes
    assert encode_lossless(data, "int32").params["shuffle"] is False


def test_xor_of_a_close_base_is_smaller_than_plain(digits: States) -> None:
    key = "model.5.weight"
    new = digits[11][key].view(np.uint8).reshape(-1)
    old = digits[10][key].view(np.uint8).reshape(-1)
    xor = _roundtrip("xor", new, old, "float32")
    assert xor.params["base"] is True and xor.params["base_step"] == 7
    assert xor.nbytes < 0.8 * encode_lossless(new, "float32").nbytes


def test_frozen_tensor_costs_almost_nothing() -> None:
    data = float_bytes("float32", 64 * 1024, special=False)
    enc = encode_chunked(data, "float32", base_hashes=chunk_hashes(data))
    assert enc.params["changed"] == 0
    assert enc.nbytes < 0.01 * data.nbytes
    out = np.empty_like(data)
    decode(enc.data, enc.params, out, data)
    assert np.array_equal(out, data)


def test_chunks_store_only_changed_chunks() -> None:
    data = float_bytes("float32", 32 * 1024, special=False)  # 128 KiB = 32 chunks of 4 KiB
    base = data.copy()
    base[5 * 4096 + 17] ^= 1
    base[20 * 4096] ^= 1
    enc = encode_chunked(data, "float32", base_hashes=chunk_hashes(base, 4096), chunk=4096)
    assert enc.params["changed"] == 2
    assert enc.hashes == chunk_hashes(data, 4096)
    assert stored_hashes(enc.data, enc.params) == enc.hashes
    assert enc.params["root"] == merkle_root(enc.hashes)


def test_chunk_hashes_of_another_layout_store_everything() -> None:
    data = float_bytes("float32", 5000)
    enc = encode_chunked(data, "float32", base_hashes=chunk_hashes(data[:-64]), chunk=4096)
    assert enc.params["base"] is False
    assert enc.params["changed"] == enc.params["nchunks"]
    out = np.empty_like(data)
    decode(enc.data, enc.params, out)
    assert np.array_equal(out, data)


def test_merkle_root_depends_on_every_leaf_and_order() -> None:
    leaves = chunk_hashes(np.arange(5 * 64, dtype=np.uint8), 64)
    roots = {merkle_root(leaves)}
    for i in range(5):
        swapped = bytearray(leaves)
        swapped[16 * i] ^= 1
        roots.add(merkle_root(bytes(swapped)))
    roots.add(merkle_root(leaves[16:32] + leaves[:16] + leaves[32:]))
    assert len(roots) == 7


# --- corruption --------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_corrupt_stored_bytes_raise(name: str) -> None:
    data = float_bytes("float32", 3000)
    base = _changed(data, 0.3)
    enc = CODECS[name](data, base, "float32")
    stored = bytes(enc.data)
    out = np.empty_like(data)
    b = base if needs_base(enc.params) else None
    bad_inputs = [
        stored[:-1],
        stored + b"\0",
        b"",
        b"XXXX" + stored[4:],
        stored[: len(stored) // 2]
        + bytes([stored[len(stored) // 2] ^ 0xFF])
        + stored[len(stored) // 2 + 1 :],
        stored[:-1] + bytes([stored[-1] ^ 1]),
    ]
    for bad in bad_inputs:
        with pytest.raises(CorruptCheckpointError):
            decode(bad, enc.params, out, b)


@pytest.mark.parametrize("name", ["xor", "chunks", "chunks-raw"])
def test_corrupt_or_missing_base_raises(name: str) -> None:
    data = float_bytes("float32", 3000)
    base = data.copy()
    base[0] ^= 1  # only the first chunk differs
    enc = CODECS[name](data, base, "float32")
    if name.startswith("chunks"):
        assert enc.params["changed"] == 1
    out = np.empty_like(data)
    wrong = base.copy()
    wrong[-3] ^= 0x10  # in the last chunk, which the data shares with this base
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, wrong)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, None)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, out, base[:-4])


@pytest.mark.parametrize("name", CODECS)
def test_bad_params_raise(name: str) -> None:
    data = float_bytes("float32", 3000)
    base = _changed(data, 0.3)
    enc = CODECS[name](data, base, "float32")
    out = np.empty_like(data)
    b = base if needs_base(enc.params) else None
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, enc.params, np.empty(data.nbytes + 4, np.uint8), b)
    for key in enc.params:
        broken = dict(enc.params)
        del broken[key]
        if key in ("base_step", "base_root", "level", "low_level", "exact"):  # informational fields
            continue
        with pytest.raises(CorruptCheckpointError):
            decode(enc.data, broken, out, b)
    for key, value in [("codec", "coci.nope/9"), ("nbytes", True), ("itemsize", "4")]:
        with pytest.raises(CorruptCheckpointError):
            decode(enc.data, {**enc.params, key: value}, out, b)
    with pytest.raises(CorruptCheckpointError):
        decode(enc.data, {**enc.params, "xxh3": "0" * 32}, out, b)


def test_config_errors() -> None:
    data = float_bytes("float32", 10)
    with pytest.raises(ConfigError):
        encode_lossless(data, "float32", segment=100)
    with pytest.raises(ConfigError):
        encode_lossless(data, "float32", level=99)
    with pytest.raises(ConfigError):
        encode_xor(data, data[:-4], "float32")
    with pytest.raises(ConfigError):
        encode_lossless(data, "notadtype")
    with pytest.raises(ConfigError):
        chunk_hashes(data, 1000)
    readonly = np.frombuffer(bytes(data.nbytes), np.uint8)
    enc = encode_lossless(data, "float32")
    with pytest.raises(ConfigError):
        decode(enc.data, enc.params, readonly)


# --- properties --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.binary(max_size=5000),
    flips=st.binary(max_size=5000),
    dtype=st.sampled_from([*FLOATS, "uint8", "int64"]),
    name=st.sampled_from(sorted(CODECS)),
)
def test_any_bytes_roundtrip(raw: bytes, flips: bytes, dtype: str, name: str) -> None:
    data = np.frombuffer(raw, np.uint8).copy()
    base = data ^ np.resize(np.frombuffer(flips or b"\0", np.uint8), data.size)
    _roundtrip(name, data, base, dtype)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(CODECS)),
    pos=st.integers(min_value=0, max_value=10**6),
    val=st.integers(min_value=1, max_value=255),
)
def test_any_single_byte_damage_is_detected(name: str, pos: int, val: int) -> None:
    """Damaged stored bytes raise, or (a bit zstd's bitstream ignores) decode exactly."""
    data = float_bytes("bfloat16", 1500, seed=3)
    base = _changed(data, 0.2)
    enc = CODECS[name](data, base, "bfloat16")
    stored = bytearray(enc.data)
    stored[pos % len(stored)] ^= val
    out = np.zeros_like(data)
    try:
        decode(bytes(stored), enc.params, out, base if needs_base(enc.params) else None)
    except CorruptCheckpointError:
        return
    assert np.array_equal(out, data)


def test_raw_through_decode() -> None:
    data = float_bytes("float32", 100)
    params = {"codec": "coci.raw/1", "nbytes": data.nbytes}
    assert not needs_base(params)
    out = np.empty_like(data)
    decode(data.tobytes(), params, out)
    assert np.array_equal(out, data)
    with pytest.raises(CorruptCheckpointError):
        decode(data.tobytes()[:-1], params, out)
    with pytest.raises(CorruptCheckpointError, match="unknown array codec"):
        decode(data.tobytes(), {**params, "codec": "evil/1"}, out)
