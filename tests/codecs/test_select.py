"""Codec selection and the "auto" decision (pure functions)."""

from __future__ import annotations

import pytest
import torch

from coci_core.codecs import choose_codec, compression_pays, time_to_durable, time_to_restore
from coci_core.errors import ConfigError

MB = 1_000_000


def test_time_to_durable_sequential_and_pipelined() -> None:
    assert time_to_durable(100 * MB, write_mbps=100) == pytest.approx(1.0)
    # 100 MB at 200 MB/s encode (0.5 s), ratio 2 -> 50 MB at 100 MB/s (0.5 s)
    seq = time_to_durable(100 * MB, write_mbps=100, encode_mbps=200, ratio=2.0)
    pipe = time_to_durable(100 * MB, write_mbps=100, encode_mbps=200, ratio=2.0, pipelined=True)
    assert seq == pytest.approx(1.0)
    assert pipe == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        time_to_durable(MB, write_mbps=0)
    with pytest.raises(ConfigError):
        time_to_durable(MB, write_mbps=1, encode_mbps=1, ratio=0)


def test_compression_pays_on_slow_storage_only() -> None:
    # measured here: shuffle+zstd ~250 MB/s at ratio 1.23 on fp32 weights + Adam
    enc, ratio = 250.0, 1.23
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=2000)  # local NVMe
    # sequential, a 1.23 ratio saves 19% of the write: it pays only below ~250 * 0.19 MB/s
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=50)
    assert compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=20)  # slow object store
    # 200 MB/s storage: sequential loses (1/250 + 1/246 > 1/200), pipelined wins
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=200)
    assert compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=200, pipelined=True)
    # the margin: a 3% win is not enough at the default 5%
    assert not compression_pays(encode_mbps=1e9, ratio=1.03, write_mbps=100)
    assert compression_pays(encode_mbps=1e9, ratio=1.03, write_mbps=100, margin=0.0)


def test_time_to_restore_reads_then_decodes() -> None:
    MB = 1_000_000
    assert time_to_restore(MB, read_mbps=100) == pytest.approx(0.01)
    # 2x smaller: half the read, plus the decode (not overlapped)
    assert time_to_restore(MB, read_mbps=100, decode_mbps=500, ratio=2) == pytest.approx(0.007)
    # a delta: decoded over its base's decoded bytes, two decodes
    assert time_to_restore(MB, read_mbps=100, decode_mbps=500, ratio=2, decodes=2) == pytest.approx(
        0.009
    )
    with pytest.raises(ConfigError, match="'decodes' must be an integer >= 1"):
        time_to_restore(MB, read_mbps=100, decode_mbps=500, decodes=0)
    bad_values = [
        ("read_mbps", {"read_mbps": 0}),
        ("read_mbps", {"read_mbps": float("nan")}),
        ("decode_mbps", {"read_mbps": 1, "decode_mbps": 0}),
        ("decode_mbps", {"read_mbps": 1, "decode_mbps": float("inf")}),
        ("ratio", {"read_mbps": 1, "ratio": -1}),
        ("ratio", {"read_mbps": 1, "ratio": True}),
    ]
    for name, bad in bad_values:
        with pytest.raises(ConfigError, match=f"'{name}' must be a finite number above 0"):
            time_to_restore(MB, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'write_mbps' must be a finite number above 0"):
        time_to_durable(MB, write_mbps=-1)
    with pytest.raises(ConfigError, match="'margin' must be a number in"):
        compression_pays(encode_mbps=1, ratio=2, write_mbps=1, margin=1.5)


def test_compression_that_slows_the_restore_does_not_pay() -> None:
    """A shorter background write is not worth a longer resume: with the decode speed known,
    compression pays only when the restore (read the smaller bytes, then decode) is no more
    than the margin slower than reading the raw bytes."""
    # 200 MB/s storage, a fast pipelined encoder, 1.5x: the write is 33% shorter
    fast_write = {"encode_mbps": 1000.0, "ratio": 1.5, "write_mbps": 200.0, "pipelined": True}
    assert compression_pays(**fast_write)  # type: ignore[arg-type]
    # decoding at 300 MB/s: a restore takes 3.3 + 3.3 ms per MB against 5 ms raw
    assert not compression_pays(**fast_write, decode_mbps=300)  # type: ignore[arg-type]
    assert compression_pays(**fast_write, decode_mbps=3000)  # type: ignore[arg-type]
    # between bases a restore decodes the base and the delta: 3.3 + 0.7 ms against 5 ms
    assert compression_pays(**fast_write, decode_mbps=3000, deltas=True)  # type: ignore[arg-type]
    assert not compression_pays(**fast_write, decode_mbps=1000, deltas=True)  # type: ignore[arg-type]
    # reads faster than writes (local disks): the raw restore is harder to beat
    assert not compression_pays(**fast_write, decode_mbps=3000, read_mbps=2000)  # type: ignore[arg-type]
    # a slow object store: compression shortens both
    slow = {"encode_mbps": 250.0, "ratio": 1.23, "write_mbps": 20.0}
    assert compression_pays(**slow, decode_mbps=600)  # type: ignore[arg-type]
    # the durable test still comes first: a restore that gains does not make a slower write pay
    assert not compression_pays(encode_mbps=250, ratio=1.23, write_mbps=2000, decode_mbps=1e9)


def test_choose_codec_modes() -> None:
    big = 1 << 20
    assert choose_codec("float32", big, "none", base="bytes") == "coci.raw/1"
    assert choose_codec("float32", 100, "lossless") == "coci.raw/1"
    assert choose_codec(torch.float32, big, "lossless") == "coci.zstd/1"
    assert choose_codec("bfloat16", big, "lossless", base="bytes") == "coci.xor-zstd/1"
    assert choose_codec("float16", big, "lossless", base="hashes") == "coci.chunks/1"
    assert choose_codec("int64", big, "lossless", base="bytes") == "coci.zstd/1"
    assert choose_codec("int64", big, "lossless", base="hashes") == "coci.chunks/1"
    assert choose_codec("float32", big, "lossy", base="reference") == "coci.qdelta/1"
    assert choose_codec("float32", big, "lossy", base="none") == "coci.zstd/1"
    assert choose_codec("int32", big, "lossy", base="reference") == "coci.zstd/1"
    assert choose_codec("float32", big, "auto", compress_pays=True) == "coci.zstd/1"
    assert choose_codec("float32", big, "auto", compress_pays=False) == "coci.raw/1"
    assert choose_codec("float32", big, "auto", base="hashes", compress_pays=False) == (
        "coci.chunks/1"
    )
    with pytest.raises(ConfigError):
        choose_codec("float32", big, "fast")  # type: ignore[arg-type]
